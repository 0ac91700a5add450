#include "checkpoint/json.h"

#include <c10/util/Exception.h>

#include <set>
#include <vector>

namespace meshddp {
namespace {

// A first pass over the text, building nothing: refuses what Note [Strict JSON] lists (nlohmann's
// own errors arrive in parse_error, with their byte). parse_json() then builds the value.
class StrictChecker : public nlohmann::json_sax<Json> {
 public:
  explicit StrictChecker(const std::string& source) : source_(source) {}

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t v) override {
    if (v > static_cast<number_unsigned_t>(INT64_MAX))
      refuse("integer " + std::to_string(v) + " out of range (not an int64)");
    return true;
  }
  bool number_float(number_float_t, const string_t& text) override {
    // nlohmann reads an integer too big for (u)int64 as a double: refuse it rather than round it.
    // (A double past the range, 1e999, is its own parse error.)
    if (text.find_first_of(".eE") == std::string::npos) refuse("integer " + text + " out of range (not an int64)");
    return true;
  }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    enter();
    keys_.emplace_back();
    return true;
  }
  bool key(string_t& k) override {
    if (!keys_.back().insert(k).second) refuse("duplicate key " + json_text(Json(k), -1, true));
    return true;
  }
  bool end_object() override {
    keys_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override {
    enter();
    return true;
  }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& e) override {
    // e.what(): "[json.exception.parse_error.101] parse error at line 1, column 12: syntax error ..."
    // or "[json.exception.out_of_range.406] number overflow parsing '1e999'": the part after the location.
    std::string what = e.what();
    if (what.rfind("[json.exception.", 0) == 0 && what.find("] ") != std::string::npos)
      what = what.substr(what.find("] ") + 2);
    if (what.rfind("parse error at line ", 0) == 0 && what.find(": ") != std::string::npos)
      what = what.substr(what.find(": ") + 2);
    // nlohmann counts the byte it stopped after; name the byte it stopped at (0-based, as an editor's offset).
    TORCH_CHECK(false, "JSON: ", what, " at byte ", position > 0 ? position - 1 : 0, " of ", source_);
  }

 private:
  [[noreturn]] void refuse(const std::string& what) const { TORCH_CHECK(false, "JSON: ", what, " in ", source_); }
  void enter() {
    if (++depth_ > kMaxJsonDepth) refuse("nesting deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  }

  const std::string& source_;
  int depth_ = 0;
  std::vector<std::set<std::string>> keys_;  // per open object
};

[[noreturn]] void mismatch(const char* expected, const Json& v, const std::string& where) {
  TORCH_CHECK(false, "JSON: expected ", expected, " at ", where, ", got ", json_kind(v));
}

}  // namespace

Json parse_json(const std::string& text, const std::string& source) {
  TORCH_CHECK(text.compare(0, 3, "\xEF\xBB\xBF") != 0, "JSON: a byte-order mark at byte 0 of ", source,
              " (JSON text starts with its value)");
  StrictChecker checker(source);
  Json::sax_parse(text, &checker, Json::input_format_t::json, /*strict=*/true, /*ignore_comments=*/false);
  return Json::parse(text);  // the same text, already checked: cannot fail
}

std::string json_text(const Json& v, int indent, bool lossy) {
  if (lossy) return v.dump(indent, ' ', false, Json::error_handler_t::replace);
  try {
    return v.dump(indent);
  } catch (const Json::type_error& e) {
    TORCH_CHECK(false, "JSON: cannot write a string that is not UTF-8 (", e.what(),
                "); names and values saved in a checkpoint must be UTF-8 text");
  }
}

std::string json_kind(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::boolean:
      return "bool";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
      return "integer";
    case Json::value_t::number_float:
      return "number";
    case Json::value_t::string:
      return "string";
    case Json::value_t::array:
      return "array";
    case Json::value_t::object:
      return "object";
    default:
      return "binary";
  }
}

int64_t json_int(const Json& v, const std::string& where) {
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) mismatch("an int64", v, where);
  if (!v.is_number_integer()) mismatch("an integer", v, where);
  return v.get<int64_t>();
}
double json_double(const Json& v, const std::string& where) {
  if (!v.is_number()) mismatch("a number", v, where);
  return v.get<double>();
}
const std::string& json_string(const Json& v, const std::string& where) {
  if (!v.is_string()) mismatch("a string", v, where);
  return v.get_ref<const std::string&>();
}
bool json_bool(const Json& v, const std::string& where) {
  if (!v.is_boolean()) mismatch("true/false", v, where);
  return v.get<bool>();
}
const Json::array_t& json_array(const Json& v, const std::string& where) {
  if (!v.is_array()) mismatch("an array", v, where);
  return v.get_ref<const Json::array_t&>();
}
const Json::object_t& json_object(const Json& v, const std::string& where) {
  if (!v.is_object()) mismatch("an object", v, where);
  return v.get_ref<const Json::object_t&>();
}
const Json& json_at(const Json& v, const std::string& key, const std::string& where) {
  const Json::object_t& o = json_object(v, where);
  auto it = o.find(key);
  TORCH_CHECK(it != o.end(), "JSON: ", where, " has no member '", key, "'");
  return it->second;
}

}  // namespace meshddp
