// The full check of one rank file of a checkpoint against its manifest (the loader runs it on every
// file before reading any): size, header, CRC32C and each piece's checksum. Internal to checkpoint/.
#pragma once

#include "manifest.h"
#include "store.h"

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

namespace meshddp {

// What is wrong with file `name` of the checkpoint in `step_dir`, checked in full ("" if nothing).
std::string file_problem(const std::string& step_dir, const std::string& name, const Manifest& m);

// "[2, 3]" for messages.
std::string shape_str(const std::vector<int64_t>& shape);

// An error's message without c10's backtrace.
std::string message_of(const std::exception& e);

// The user values of a save as the JSON object the headers and the manifest record (finite numbers only).
Json values_to_json(const CheckpointValues& values);

}  // namespace meshddp
