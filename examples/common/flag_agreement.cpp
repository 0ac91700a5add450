#include "examples/common/flag_agreement.h"

#include "mesh/collectives.h"

#include <c10/util/Exception.h>

#include <map>
#include <meshddp/meshddp.h>
#include <sstream>

namespace examples {

std::vector<std::pair<std::string, std::string>> flags_of_command_line(int argc, char** argv) {
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0) continue;  // a stray value; a flag's value is taken with it below
    const bool has_value = i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0;
    flags[arg] = has_value ? argv[++i] : "(set)";
  }
  return {flags.begin(), flags.end()};
}

void verify_same_flags_across_ranks(const meshddp::DeviceMesh& mesh, int argc, char** argv,
                                    const std::string& program) {
  std::string mine;
  for (const auto& [flag, value] : flags_of_command_line(argc, argv)) mine += flag + "\n" + value + "\n";
  c10d::ProcessGroup& world = *mesh.world();
  if (world.getSize() == 1) return;
  const auto all = meshddp::all_gather_strings(world, mine, "the command-line flags check");
  // flag -> each rank's value; a rank that did not give the flag reads "(not given)".
  std::map<std::string, std::vector<std::string>> by_flag;
  for (size_t r = 0; r < all.size(); ++r) {
    std::istringstream lines(all[r]);
    for (std::string flag, value; std::getline(lines, flag) && std::getline(lines, value);) {
      auto& values = by_flag[flag];
      values.resize(all.size(), "(not given)");
      values[r] = value;
    }
  }
  for (auto& [flag, values] : by_flag) {  // in flag order, so every rank names the same one
    values.resize(all.size(), "(not given)");
    std::string each;
    bool differs = false;
    for (size_t r = 0; r < values.size(); ++r) {
      differs = differs || values[r] != values[0];
      each += (r ? ", rank " : "rank ") + std::to_string(r) + ": " + values[r];
    }
    TORCH_CHECK(!differs, program, ": the command-line flags differ across the ranks of ",
                meshddp::describe_group(world), ": '", flag, "' is ", each,
                ". Start every rank with the same flags (torchrun does)");
  }
}

}  // namespace examples
