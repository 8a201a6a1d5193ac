#include "deploy/local_ranks.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "common/transport/factory.h"
#include "memory_node/memory_rank.h"

namespace tandem {

absl::StatusOr<std::unique_ptr<LocalMemoryRanks>> LocalMemoryRanks::Start(
    const std::vector<std::string>& devices, const LocalRankTimeouts& timeouts) {
  if (devices.empty()) return absl::InvalidArgumentError("local memory ranks: no device given");
  std::unique_ptr<LocalMemoryRanks> r(new LocalMemoryRanks());
  LocalMemoryRanks* self = r.get();
  {
    std::lock_guard<std::mutex> lock(r->mu_);
    r->ranks_.resize(devices.size());
  }
  for (size_t m = 0; m < devices.size(); ++m) {
    MemoryRankOptions o;
    o.rank = static_cast<int>(m);
    o.device = devices[m];
    o.kv_share = static_cast<int>(std::count(devices.begin(), devices.end(), devices[m]));
    o.transport = transport::TransportKind::kLocal;
    o.startup_timeout = timeouts.startup;
    o.step_timeout = timeouts.step;
    o.tiers = timeouts.tiers;
    o.model = timeouts.model;
    o.on_listening = [self, m](const std::string& address) {
      std::lock_guard<std::mutex> lock(self->mu_);
      self->ranks_[m].address = address;
      self->cv_.notify_all();
      return absl::OkStatus();
    };
    o.stop_requested = [self] { return self->stop_.load(); };
    std::thread t([self, m, o] {
      absl::Status st = RunMemoryRank(o);
      std::lock_guard<std::mutex> lock(self->mu_);
      self->ranks_[m].status = std::move(st);
      self->ranks_[m].done = true;
      self->cv_.notify_all();
    });
    std::lock_guard<std::mutex> lock(r->mu_);
    r->ranks_[m].thread = std::move(t);
  }
  // Every rank listening, or the first that ended (none has been told to stop yet).
  std::unique_lock<std::mutex> lock(r->mu_);
  auto settled = [self] {
    for (const Rank& k : self->ranks_) {
      if (k.done) return true;
      if (k.address.empty()) return false;
    }
    return true;
  };
  if (!r->cv_.wait_for(lock, absl::ToChronoSeconds(timeouts.startup), settled)) {
    lock.unlock();
    return absl::DeadlineExceededError("local memory ranks: not listening within the startup timeout");
  }
  for (size_t m = 0; m < r->ranks_.size(); ++m) {
    const Rank& k = r->ranks_[m];
    if (k.done) {
      const absl::Status st =
          Annotate(k.status.ok() ? absl::InternalError("ended before it listened") : k.status,
                   absl::StrCat("memory rank ", m, " (", devices[m], ")"));
      lock.unlock();
      return st;  // the destructor stops and joins the others
    }
    r->addresses_.push_back(k.address);
  }
  lock.unlock();
  return r;
}

absl::Status LocalMemoryRanks::Join(absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  auto all_done = [this] {
    for (const Rank& k : ranks_) {
      if (!k.done) return false;
    }
    return true;
  };
  if (!cv_.wait_until(lock, absl::ToChronoTime(deadline), all_done)) {
    std::vector<std::string> running;
    for (size_t m = 0; m < ranks_.size(); ++m) {
      if (!ranks_[m].done) running.push_back(absl::StrCat(m));
    }
    return absl::DeadlineExceededError(absl::StrCat("memory rank(s) ", absl::StrJoin(running, ", "),
                                                    " still running after the compute rank's bye"));
  }
  for (size_t m = 0; m < ranks_.size(); ++m) {
    if (!ranks_[m].status.ok()) return Annotate(ranks_[m].status, absl::StrCat("memory rank ", m));
  }
  return absl::OkStatus();
}

LocalMemoryRanks::~LocalMemoryRanks() {
  stop_ = true;
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Rank& k : ranks_) threads.push_back(std::move(k.thread));
  }
  for (std::thread& t : threads) {
    if (t.joinable()) t.join();
  }
}

}  // namespace tandem
