// JSON for checkpoint manifests, safetensors headers and the ranks' status messages: nlohmann-json
// (pinned, installed by scripts/setup.sh; docs/reference/building.md) read strictly, with typed access that
// names the field on a mismatch. Objects keep their keys sorted (std::map), so output is deterministic;
// integers stay exact as int64 (shapes and offsets must round-trip), other numbers are doubles.
//
// Note [Strict JSON]
// parse_json() refuses, naming the source, what nlohmann's own parser accepts but a checkpoint must
// not hold: a key twice in one object (nlohmann keeps the last: an edit could hide behind it), an
// integer outside int64 (nlohmann reads it as uint64 or as a rounded double), nesting deeper than
// kMaxJsonDepth, and a byte-order mark. nlohmann refuses the rest itself: a number past the double
// range (1e999), malformed escapes and lone surrogates, raw control characters and invalid UTF-8 in
// strings, leading zeros, NaN, trailing bytes. (meshddp-consolidate reads through this parser.)
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace meshddp {

using Json = nlohmann::json;

constexpr int kMaxJsonDepth = 64;

// Throws "JSON: <what> ... of <source>" (with the byte where nlohmann found it) on anything malformed
// or refused by Note [Strict JSON].
Json parse_json(const std::string& text, const std::string& source);

// Compact text (indent < 0), or one member or element per line. Throws naming the component when a
// string is not UTF-8 (JSON holds text only). Never throws with `lossy`: invalid UTF-8 becomes U+FFFD
// (for error messages passed between ranks, which must arrive whatever they hold).
std::string json_text(const Json& v, int indent = -1, bool lossy = false);

// "null", "bool", "integer", "number", "string", "array", "object".
std::string json_kind(const Json& v);

// Typed access; each throws "JSON: expected <type> at <where>, got <kind>" on a mismatch.
int64_t json_int(const Json& v, const std::string& where);
double json_double(const Json& v, const std::string& where);  // an integer or a number
const std::string& json_string(const Json& v, const std::string& where);
bool json_bool(const Json& v, const std::string& where);
const Json::array_t& json_array(const Json& v, const std::string& where);
const Json::object_t& json_object(const Json& v, const std::string& where);
// Member `key` of the object `v`; throws naming `where` and `key` when it is absent.
const Json& json_at(const Json& v, const std::string& key, const std::string& where);

}  // namespace meshddp
