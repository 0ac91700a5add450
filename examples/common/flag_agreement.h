// Every rank of an example must run with the same flags: a rank started with another --heads, --lr
// or --optimizer would otherwise train on silently (other losses, exit 0) or hang. One collective
// at start compares the whole command line across the mesh and names the first flag that differs.
#pragma once

#include <meshddp/meshddp.h>
#include <string>
#include <utility>
#include <vector>

namespace examples {

// The command line as (flag, value) pairs, sorted by flag: "--lr 0.1" -> ("--lr", "0.1"); a flag
// followed by another flag (or last) has the value "(set)"; a repeated flag keeps its last value.
// Pure.
std::vector<std::pair<std::string, std::string>> flags_of_command_line(int argc, char** argv);

// A collective over the whole mesh (two small all-gathers): throws on every rank, naming the first
// flag (in sorted order) that differs and each rank's value, e.g. "gpt_example: the command-line
// flags differ across the ranks of group ...: '--heads' is rank 0: 4, rank 1: 2". A flag given on
// some ranks only reads "(not given)" on the others (even when its default is the same value:
// write the same command line on every rank). Call it right after the mesh is built.
void verify_same_flags_across_ranks(const meshddp::DeviceMesh& mesh, int argc, char** argv, const std::string& program);

}  // namespace examples
