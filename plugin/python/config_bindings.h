// Python bindings of a config struct driven by its one field list (mesh/config_fields.h): keyword
// arguments at construction, a validated property per field, field_names() and __repr__. So every
// field in the C++ list is settable, readable and shown from Python, by its C++ name, with no list
// here to keep in step. Enums are strings ("adamw"), group rules (pattern, lr | None, wd | None).
#pragma once

#include "mesh/config_fields.h"
#include "optimizer/optimizer_config_fields.h"

#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace meshddp::python {

namespace py = pybind11;

using RuleTuple = std::tuple<std::string, std::optional<double>, std::optional<double>>;

template <typename T>
py::object to_python(const T& v) {
  if constexpr (std::is_enum_v<T>) {
    return py::str(field_text(v));
  } else if constexpr (std::is_same_v<T, std::vector<ParamGroupRule>>) {
    py::list out;
    for (const auto& r : v) out.append(py::cast(RuleTuple{r.pattern, r.lr, r.weight_decay}));
    return out;
  } else if constexpr (std::is_same_v<T, size_t>) {
    return py::int_(static_cast<int64_t>(v));
  } else {
    return py::cast(v);
  }
}

// What a field of type T takes from Python, for messages.
template <typename T>
const char* python_type_text() {
  if constexpr (std::is_same_v<T, bool>)
    return "True or False";
  else if constexpr (std::is_integral_v<T>)
    return "an int";
  else if constexpr (std::is_floating_point_v<T>)
    return "a float";
  else if constexpr (std::is_same_v<T, std::string>)
    return "a str";
  else if constexpr (std::is_enum_v<T>)
    return "a str naming a value";
  else
    return "a list of (pattern, lr or None, weight_decay or None)";
}

// `value` as the field's type; a wrong type (a bool for a number included) or a negative size is an
// error naming the field.
template <typename T>
T from_python(py::handle value, const char* type, const char* name) {
  auto wrong_type = [&] {
    return py::type_error(std::string(type) + ": " + name + " must be " + python_type_text<T>() + ", got " +
                          py::cast<std::string>(py::repr(value)));
  };
  const bool is_bool = py::isinstance<py::bool_>(value);
  if (std::is_same_v<T, bool> != is_bool) throw wrong_type();
  try {
    if constexpr (std::is_enum_v<T>) {
      return enum_from_text<T>(py::cast<std::string>(value), type, name);
    } else if constexpr (std::is_same_v<T, std::vector<ParamGroupRule>>) {
      std::vector<ParamGroupRule> rules;
      for (const auto& [pattern, lr, wd] : py::cast<std::vector<RuleTuple>>(value)) rules.push_back({pattern, lr, wd});
      return rules;
    } else if constexpr (std::is_same_v<T, size_t>) {
      const auto v = py::cast<int64_t>(value);
      TORCH_CHECK(v >= 0, type, ": ", name, " = ", v, " is negative; it must be >= 0");
      return static_cast<size_t>(v);
    } else {
      return py::cast<T>(value);
    }
  } catch (const py::cast_error&) {
    throw wrong_type();
  }
}

template <typename Fields>
std::string field_names_text(const Fields& fields) {
  std::string out;
  for_each_field(fields, [&](const auto& f) { out += (out.empty() ? "" : ", ") + std::string(f.name); });
  return out;
}

// Binds `Config` as `cls` with `fields`: Config(**kwargs) (each keyword a field), a property per
// field, validate(), _settings() (each field's text, as the cross-rank agreement compares them),
// field_names() and __repr__ "<python_name>(a=1, b=True, ...)" with every field. A value of the
// wrong type is refused at once; the ranges are checked by validate(), which the wrapper that takes
// the config calls after the ranks agreed on it (Note [Agree first, then validate],
// mesh/config_fields.h): a value invalid on one rank only then fails every rank alike, naming it.
template <typename Config, typename Fields>
void bind_config_fields(py::class_<Config>& cls, const Fields& fields, const char* python_name) {
  cls.def(py::init([fields, python_name](const py::kwargs& kwargs) {
    Config config;
    for (const auto& item : kwargs) {
      const auto key = py::cast<std::string>(item.first);
      bool found = false;
      for_each_field(fields, [&](const auto& f) {
        using T = typename std::decay_t<decltype(f)>::Value;
        if (key != f.name) return;
        config.*(f.member) = from_python<T>(item.second, python_name, f.name);
        found = true;
      });
      if (!found) {
        throw py::type_error(std::string(python_name) + ": no field '" + key + "'; the fields are " +
                             field_names_text(fields));
      }
    }
    return config;
  }));
  cls.def("validate", &Config::validate, "checks every field's range (a RuntimeError naming the field)");
  cls.def("_settings", [fields](const Config& c) { return field_settings(c, fields); });
  for_each_field(fields, [&](const auto& f) {
    using T = typename std::decay_t<decltype(f)>::Value;
    const auto member = f.member;
    const char* name = f.name;
    cls.def_property(
        name, [member](const Config& c) { return to_python(c.*member); },
        [member, name, python_name](Config& c, py::handle value) {
          c.*member = from_python<T>(value, python_name, name);
        });
  });
  cls.def_static(
      "field_names",
      [fields] {
        py::list names;
        for_each_field(fields, [&](const auto& f) { names.append(f.name); });
        return py::tuple(names);
      },
      "the names of every field, from the C++ field list");
  cls.def("__repr__", [fields, python_name](const Config& c) {
    std::string out = std::string(python_name) + "(";
    bool first = true;
    for_each_field(fields, [&](const auto& f) {
      out +=
          (first ? "" : ", ") + std::string(f.name) + "=" + py::cast<std::string>(py::repr(to_python(c.*(f.member))));
      first = false;
    });
    return out + ")";
  });
}

}  // namespace meshddp::python
