// Memory ranks as threads of this process, for transport.kind local (common/transport/local):
// compute rank 0's process hosts them, so that ranks sharing one GPU share one CUDA context
// (docs/architecture.md, "Processes"). Each thread runs RunMemoryRank (memory_node/memory_rank.h)
// exactly as a `tandem memory` process would, over the local transport.
//
//   ASSIGN_OR_RETURN(auto ranks, LocalMemoryRanks::Start({"cuda:0"}, timeouts));
//   options.memory_addresses = ranks->addresses();   // then ComputeRank::Create(...), Step, ...
//   rank->Shutdown();                                 // the bye ends each memory rank's thread
//   RETURN_IF_ERROR(ranks->Join(absl::Now() + absl::Seconds(20)));
//
// Destroying the object asks any rank still running to stop and joins every thread; a rank whose
// compute rank went away ends with Unavailable on its own.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "memory_node/kv_tier_store.h"

namespace tandem {

struct LocalRankTimeouts {
  absl::Duration startup = absl::Minutes(10);  // MemoryRankOptions::startup_timeout
  absl::Duration step = absl::Minutes(2);      // MemoryRankOptions::step_timeout
  // KV tiers of each rank (MemoryRankOptions::tiers and ::model; disk files under
  // disk_dir/rank-<m>/); off by default.
  KvTierOptions tiers;
  std::string model;
};

class LocalMemoryRanks {
 public:
  // One thread per device ("cpu", "cuda:N"), memory rank m on devices[m]. Returns once every rank
  // listens, with their addresses in rank order; the first rank error otherwise (the others are
  // stopped).
  static absl::StatusOr<std::unique_ptr<LocalMemoryRanks>> Start(const std::vector<std::string>& devices,
                                                                 const LocalRankTimeouts& timeouts);
  ~LocalMemoryRanks();
  LocalMemoryRanks(const LocalMemoryRanks&) = delete;
  LocalMemoryRanks& operator=(const LocalMemoryRanks&) = delete;

  const std::vector<std::string>& addresses() const { return addresses_; }
  // Waits until every rank has ended (after its bye) or `deadline` passes (DeadlineExceeded naming
  // the ranks still running); the first rank's error otherwise, annotated with its index.
  absl::Status Join(absl::Time deadline);

 private:
  LocalMemoryRanks() = default;

  struct Rank {
    std::thread thread;
    std::string address;  // set once it listens
    bool done = false;
    absl::Status status;
  };
  std::mutex mu_;
  std::condition_variable cv_;  // a rank listens or ends
  std::vector<Rank> ranks_;     // guarded by mu_
  std::vector<std::string> addresses_;
  std::atomic<bool> stop_{false};
};

}  // namespace tandem
