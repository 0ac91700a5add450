#include "checkpoint/json_value.h"

#include <c10/util/Exception.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace meshddp {

std::string JsonValue::kind() const {
  static const char* names[] = {"null", "bool", "integer", "number", "string", "array", "object"};
  return names[v_.index()];
}

int64_t JsonValue::as_int(const std::string& where) const {
  TORCH_CHECK(is_int(), "JSON: expected an integer at ", where, ", got ", kind());
  return std::get<int64_t>(v_);
}
double JsonValue::as_double(const std::string& where) const {
  if (is_int()) return static_cast<double>(std::get<int64_t>(v_));
  TORCH_CHECK(std::holds_alternative<double>(v_), "JSON: expected a number at ", where, ", got ", kind());
  return std::get<double>(v_);
}
const std::string& JsonValue::as_string(const std::string& where) const {
  TORCH_CHECK(is_string(), "JSON: expected a string at ", where, ", got ", kind());
  return std::get<std::string>(v_);
}
const JsonValue::Array& JsonValue::as_array(const std::string& where) const {
  TORCH_CHECK(is_array(), "JSON: expected an array at ", where, ", got ", kind());
  return std::get<Array>(v_);
}
const JsonValue::Object& JsonValue::as_object(const std::string& where) const {
  TORCH_CHECK(is_object(), "JSON: expected an object at ", where, ", got ", kind());
  return std::get<Object>(v_);
}
bool JsonValue::as_bool(const std::string& where) const {
  TORCH_CHECK(std::holds_alternative<bool>(v_), "JSON: expected true/false at ", where, ", got ", kind());
  return std::get<bool>(v_);
}
const JsonValue& JsonValue::at(const std::string& key, const std::string& where) const {
  const Object& o = as_object(where);
  auto it = o.find(key);
  TORCH_CHECK(it != o.end(), "JSON: ", where, " has no member '", key, "'");
  return it->second;
}
bool JsonValue::has(const std::string& key) const { return is_object() && std::get<Object>(v_).count(key) > 0; }

JsonValue::Array& JsonValue::array() {
  if (is_null()) v_ = Array{};
  return std::get<Array>(v_);
}
JsonValue::Object& JsonValue::object() {
  if (is_null()) v_ = Object{};
  return std::get<Object>(v_);
}

namespace {

void dump_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void newline(std::string& out, int indent, int depth) {
  if (indent <= 0) return;
  out += '\n';
  out.append(static_cast<size_t>(indent * depth), ' ');
}

class Parser {
 public:
  Parser(const std::string& text, const std::string& source) : s_(text), source_(source) {}

  JsonValue document() {
    JsonValue v = value(0);
    skip_space();
    expect(pos_ == s_.size(), "trailing bytes after the value");
    return v;
  }

 private:
  void expect(bool ok, const char* what) const {
    TORCH_CHECK(ok, "JSON: ", what, " at byte ", pos_, " of ", source_);
  }
  void skip_space() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\t' || s_[pos_] == '\r')) ++pos_;
  }
  bool consume(const char* word) {
    const size_t n = std::char_traits<char>::length(word);
    if (s_.compare(pos_, n, word) != 0) return false;
    pos_ += n;
    return true;
  }
  JsonValue value(int depth) {
    expect(depth < 64, "nesting too deep");
    skip_space();
    expect(pos_ < s_.size(), "unexpected end");
    const char c = s_[pos_];
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    if (c == '"') return JsonValue(string());
    if (consume("null")) return JsonValue();
    if (consume("true")) return JsonValue(true);
    if (consume("false")) return JsonValue(false);
    return number();
  }
  JsonValue object(int depth) {
    ++pos_;
    JsonValue::Object o;
    skip_space();
    if (pos_ < s_.size() && s_[pos_] == '}') { ++pos_; return JsonValue(std::move(o)); }
    while (true) {
      skip_space();
      expect(pos_ < s_.size() && s_[pos_] == '"', "expected a string key");
      std::string key = string();
      skip_space();
      expect(pos_ < s_.size() && s_[pos_] == ':', "expected ':'");
      ++pos_;
      expect(o.count(key) == 0, "duplicate key");
      o.emplace(std::move(key), value(depth + 1));
      skip_space();
      expect(pos_ < s_.size(), "unexpected end in an object");
      if (s_[pos_] == ',') { ++pos_; continue; }
      expect(s_[pos_] == '}', "expected ',' or '}'");
      ++pos_;
      return JsonValue(std::move(o));
    }
  }
  JsonValue array(int depth) {
    ++pos_;
    JsonValue::Array a;
    skip_space();
    if (pos_ < s_.size() && s_[pos_] == ']') { ++pos_; return JsonValue(std::move(a)); }
    while (true) {
      a.push_back(value(depth + 1));
      skip_space();
      expect(pos_ < s_.size(), "unexpected end in an array");
      if (s_[pos_] == ',') { ++pos_; continue; }
      expect(s_[pos_] == ']', "expected ',' or ']'");
      ++pos_;
      return JsonValue(std::move(a));
    }
  }
  std::string string() {
    ++pos_;  // opening quote
    std::string out;
    while (true) {
      expect(pos_ < s_.size(), "unterminated string");
      const char c = s_[pos_++];
      if (c == '"') return out;
      if (c != '\\') { out += c; continue; }
      expect(pos_ < s_.size(), "unterminated escape");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned code = hex4();
          if (code >= 0xD800 && code < 0xDC00) {  // a high surrogate: a low one must follow
            expect(s_.compare(pos_, 2, "\\u") == 0, "lone surrogate in a \\u escape");
            pos_ += 2;
            const unsigned low = hex4();
            expect(low >= 0xDC00 && low < 0xE000, "lone surrogate in a \\u escape");
            code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
          }
          expect(code < 0xDC00 || code >= 0xE000, "lone surrogate in a \\u escape");
          // UTF-8.
          if (code >= 0x10000) {
            out += static_cast<char>(0xF0 | (code >> 18));
            out += static_cast<char>(0x80 | ((code >> 12) & 0x3F));
            out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (code & 0x3F));
          } else if (code < 0x80) {
            out += static_cast<char>(code);
          } else if (code < 0x800) {
            out += static_cast<char>(0xC0 | (code >> 6));
            out += static_cast<char>(0x80 | (code & 0x3F));
          } else {
            out += static_cast<char>(0xE0 | (code >> 12));
            out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (code & 0x3F));
          }
          break;
        }
        default: expect(false, "bad escape");
      }
    }
  }
  // The 4 hex digits of a \u escape (pos_ just after the "u").
  unsigned hex4() {
    expect(pos_ + 4 <= s_.size(), "short \\u escape");
    unsigned code = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = s_[pos_];
      expect(std::isxdigit(static_cast<unsigned char>(h)) != 0, "bad \\u escape (expected 4 hex digits)");
      code = code * 16 + static_cast<unsigned>(h <= '9' ? h - '0' : (h | 0x20) - 'a' + 10);
      ++pos_;
    }
    return code;
  }
  JsonValue number() {
    const size_t start = pos_;
    bool is_float = false;
    if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c >= '0' && c <= '9') { ++pos_; continue; }
      if (c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-') { is_float = true; ++pos_; continue; }
      break;
    }
    expect(pos_ > start && !(pos_ == start + 1 && s_[start] == '-'), "expected a value");
    const std::string text = s_.substr(start, pos_ - start);
    char* end = nullptr;
    if (!is_float) {
      errno = 0;
      const long long v = std::strtoll(text.c_str(), &end, 10);
      expect(errno == 0 && *end == '\0', "bad integer");
      return JsonValue(static_cast<int64_t>(v));
    }
    const double v = std::strtod(text.c_str(), &end);
    expect(*end == '\0', "bad number");
    expect(std::isfinite(v), "number out of range (not a finite double)");
    return JsonValue(v);
  }

  const std::string& s_;
  const std::string& source_;
  size_t pos_ = 0;
};

}  // namespace

void JsonValue::dump_to(std::string& out, int indent, int depth) const {
  switch (v_.index()) {
    case 0: out += "null"; break;
    case 1: out += std::get<bool>(v_) ? "true" : "false"; break;
    case 2: out += std::to_string(std::get<int64_t>(v_)); break;
    case 3: {
      const double d = std::get<double>(v_);
      TORCH_CHECK(std::isfinite(d), "JSON: cannot write the non-finite number ", d);
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.17g", d);
      std::string text = buf;
      if (text.find_first_of(".eE") == std::string::npos) text += ".0";  // stays a double when read back
      out += text;
      break;
    }
    case 4: dump_string(out, std::get<std::string>(v_)); break;
    case 5: {
      const Array& a = std::get<Array>(v_);
      out += '[';
      for (size_t i = 0; i < a.size(); ++i) {
        if (i) out += ',';
        a[i].dump_to(out, indent, depth + 1);
      }
      out += ']';
      break;
    }
    case 6: {
      const Object& o = std::get<Object>(v_);
      out += '{';
      bool first = true;
      for (const auto& [key, value] : o) {
        if (!first) out += ',';
        first = false;
        newline(out, indent, depth + 1);
        dump_string(out, key);
        out += indent > 0 ? ": " : ":";
        value.dump_to(out, indent, depth + 1);
      }
      if (!o.empty()) newline(out, indent, depth);
      out += '}';
      break;
    }
  }
}

std::string JsonValue::dump(int indent) const {
  std::string out;
  dump_to(out, indent, 0);
  return out;
}

JsonValue JsonValue::parse(const std::string& text, const std::string& source) { return Parser(text, source).document(); }

}  // namespace meshddp
