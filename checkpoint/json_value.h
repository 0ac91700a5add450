// A small JSON value (null, bool, number, string, array, object) with a writer and a strict parser,
// for checkpoint manifests and safetensors headers. Not a general-purpose JSON library: numbers are
// kept as int64 when written without '.', 'e' or 'E' (shapes and offsets must round-trip exactly),
// as double otherwise; objects keep their keys sorted (std::map), which makes output deterministic.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

namespace meshddp {

class JsonValue {
 public:
  using Array = std::vector<JsonValue>;
  using Object = std::map<std::string, JsonValue>;

  JsonValue() = default;  // null
  JsonValue(bool b) : v_(b) {}
  JsonValue(int v) : v_(static_cast<int64_t>(v)) {}
  JsonValue(int64_t v) : v_(v) {}
  JsonValue(uint64_t v) : v_(static_cast<int64_t>(v)) {}
  JsonValue(double v) : v_(v) {}
  JsonValue(const char* s) : v_(std::string(s)) {}
  JsonValue(std::string s) : v_(std::move(s)) {}
  JsonValue(Array a) : v_(std::move(a)) {}
  JsonValue(Object o) : v_(std::move(o)) {}

  bool is_null() const { return std::holds_alternative<std::monostate>(v_); }
  bool is_int() const { return std::holds_alternative<int64_t>(v_); }
  bool is_number() const { return is_int() || std::holds_alternative<double>(v_); }
  bool is_string() const { return std::holds_alternative<std::string>(v_); }
  bool is_array() const { return std::holds_alternative<Array>(v_); }
  bool is_object() const { return std::holds_alternative<Object>(v_); }

  // Typed access; each throws "JSON: expected <type> at <where>, got <kind>" on a mismatch.
  int64_t as_int(const std::string& where) const;
  double as_double(const std::string& where) const;
  const std::string& as_string(const std::string& where) const;
  const Array& as_array(const std::string& where) const;
  const Object& as_object(const std::string& where) const;
  bool as_bool(const std::string& where) const;
  // Member `key` of an object; throws naming `where` and `key` when it is absent.
  const JsonValue& at(const std::string& key, const std::string& where) const;
  bool has(const std::string& key) const;

  Array& array();    // makes this an array if null
  Object& object();  // makes this an object if null

  // Compact JSON (no spaces), or with `indent` > 0 one member per line.
  std::string dump(int indent = 0) const;
  // Throws "JSON: <what> at byte <n> of <source>" on anything malformed (including trailing bytes).
  static JsonValue parse(const std::string& text, const std::string& source);

  std::string kind() const;

 private:
  void dump_to(std::string& out, int indent, int depth) const;
  std::variant<std::monostate, bool, int64_t, double, std::string, Array, Object> v_;
};

}  // namespace meshddp
