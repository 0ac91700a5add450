// The environment switches (mesh/switches.h): values, overrides, and docs/reference/environment.md's
// table against the one list in the header.
#include "mesh/switches.h"

#include "tests/support/error_of.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <string>

using namespace meshddp;
using ::testing::HasSubstr;

TEST(Switches, OneIsOnZeroIsOffUnsetOrEmptyIsTheDefault) {
  for (const SwitchSpec& spec : kSwitches) {
    SCOPED_TRACE(std::string(spec.name));
    EXPECT_TRUE(parse_switch(spec, "1"));
    EXPECT_FALSE(parse_switch(spec, "0"));
    EXPECT_EQ(parse_switch(spec, nullptr), spec.default_on);
    EXPECT_EQ(parse_switch(spec, ""), spec.default_on);
  }
}

TEST(Switches, AnyOtherValueIsAnErrorNamingTheVariable) {
  const std::string error = test::error_of([] { parse_switch(switch_spec(Switch::kNcclSplit), "false"); });
  EXPECT_THAT(error, HasSubstr("environment variable MESHDDP_NCCL_SPLIT=false is not 0 or 1 (unset: 1)"));
}

TEST(Switches, ATestOverrideWinsUntilCleared) {
  const bool from_env = switch_on(Switch::kForceCollectives);
  override_switch_for_testing(Switch::kForceCollectives, !from_env);
  EXPECT_EQ(switch_on(Switch::kForceCollectives), !from_env);
  override_switch_for_testing(Switch::kForceCollectives, std::nullopt);
  EXPECT_EQ(switch_on(Switch::kForceCollectives), from_env);
}

// Every row of docs/reference/environment.md's "Runtime switches" table names a switch of kSwitches
// with its default, and every switch has a row.
TEST(Switches, DocsTableListsEverySwitchWithItsDefault) {
  // GCC 12 -Warray-bounds misfired on string +
  std::ifstream docs(MESHDDP_SOURCE_DIR "/docs/reference/environment.md");
  ASSERT_TRUE(docs) << "cannot read docs/reference/environment.md";
  std::map<std::string, std::string> documented;  // name -> default column
  for (std::string line; std::getline(docs, line);) {
    if (line.rfind("## Build", 0) == 0) break;  // the scripts' variables, not runtime switches
    if (line.rfind("| `MESHDDP_", 0) != 0) continue;
    const std::string name = line.substr(3, line.find_first_of("=`", 3) - 3);
    const size_t second = line.find('|', 1) + 1;
    std::string default_column = line.substr(second, line.find('|', second) - second);
    default_column.erase(0, default_column.find_first_not_of(' '));
    default_column.erase(default_column.find_last_not_of(' ') + 1);
    documented[name] = default_column;
  }
  for (const SwitchSpec& spec : kSwitches) {
    const std::string name(spec.name);
    ASSERT_TRUE(documented.count(name)) << name << " has no row in docs/reference/environment.md's switches table";
    EXPECT_EQ(documented[name], spec.default_on ? "on" : "off") << name;
    documented.erase(name);
  }
  for (const auto& [name, unused] : documented)
    ADD_FAILURE() << "docs/reference/environment.md documents " << name << ", not in kSwitches";
}
