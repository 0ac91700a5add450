// The launch round: a number every rank of one launch of a job agrees on, different from every
// earlier launch that used the same store, so that a mesh's store keys (group rendezvous, agreements,
// progress records) never meet the entries a previous launch left there. Store operations only: no
// process group exists yet when it is needed.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <string>

namespace meshddp {

// Note [Launch rounds]
// torchrun's elastic agent (c10d rendezvous, TORCHELASTIC_USE_AGENT_STORE=True) serves one TCPStore
// for the whole job, kept across restart rounds: when a worker dies, the restarted workers meet in
// the same store the dead ones wrote to. Keys that are the same in every round (a group's
// rendezvous "meshddp/dp/ranks=0,2/...", an agreement's counters) would then be read back from the
// previous round: restarted ranks connect to dead peers' addresses and wait. TORCHELASTIC_RESTART_COUNT
// is no round number: it counts this agent's restarts, and an agent that restarts because another
// one's worker failed does not count it (elastic/agent/server/api.py), so agents disagree on it.
// So the ranks agree on a round through the store itself:
//   - rank 0 takes the next round number e (an atomic add on `<prefix>/rounds`: each launch's rank 0
//     takes one, so e is new);
//   - every other rank writes a nonce of its own (host, pid, random) to `<prefix>/ask/<rank>` and
//     waits for `<prefix>/answer/<nonce>`: no earlier launch can have written that key;
//   - rank 0 answers every nonce it finds under `ask/` with e, until each rank has acknowledged e
//     under `<prefix>/<e>/ack/<rank>` (a nonce a dead process left is answered too, and unread).
// The ranks of a launch start after every process of the previous one has ended (the agent stops
// its workers before the next rendezvous), so no stale process writes during the handshake.

// The launch round of this process's launch, agreed with the other `world_size` ranks through
// `store` under `prefix`; 1 in a fresh store. Every rank calls it once per launch, concurrently. A
// rank that does not join within `timeout` fails every waiting rank naming it.
int64_t agree_on_launch_round(c10d::Store& store, const std::string& prefix, int64_t rank, int64_t world_size,
                              std::chrono::milliseconds timeout);

// Whether the store torchrun's elastic agent serves outlives the workers of this launch:
// TORCHELASTIC_USE_AGENT_STORE=True in the environment.
bool store_outlives_launch();

}  // namespace meshddp
