#include "common/transport/fault/fault_transport.h"

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"

namespace tandem::transport {
namespace {

// Receive and WaitDoorbell poll the inner transport in slices this long, so that stalls end and
// held messages are delivered while they wait.
constexpr absl::Duration kSlice = absl::Milliseconds(5);

const char* ActionName(FaultAction a) {
  switch (a) {
    case FaultAction::kDrop:
      return "drop";
    case FaultAction::kDelay:
      return "delay";
    case FaultAction::kDuplicate:
      return "dup";
    case FaultAction::kCorrupt:
      return "corrupt";
    case FaultAction::kCut:
      return "cut";
    case FaultAction::kStall:
      return "stall";
  }
  return "?";
}

const char* OpName(uint8_t op) {
  switch (op) {
    case kFaultSend:
      return "send";
    case kFaultReceive:
      return "receive";
    default:
      return "write";
  }
}

absl::Status RuleError(std::string_view source, size_t index, std::string_view rule,
                       const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat(ToAbsl(source), ": rule ", index, " \"", ToAbsl(rule), "\": ", what));
}

absl::StatusOr<FaultRule> ParseRule(std::string_view source, size_t index, std::string_view text) {
  FaultRule rule;
  rule.text = std::string(text);
  // on= comes last and takes the rest of the rule: process tags contain ':' ("memory:1").
  std::string_view body = text, on;
  if (const size_t p = text.find(":on="); p != std::string_view::npos) {
    body = text.substr(0, p);
    on = text.substr(p + 4);
    if (on.empty()) return RuleError(source, index, text, "on=: expected a process tag such as memory:1");
    rule.process = std::string(on);
  }
  std::vector<std::string> fields = absl::StrSplit(ToAbsl(body), ':');
  const std::string& action = fields[0];
  if (action == "drop") {
    rule.action = FaultAction::kDrop;
  } else if (action == "delay") {
    rule.action = FaultAction::kDelay;
  } else if (action == "dup" || action == "duplicate") {
    rule.action = FaultAction::kDuplicate;
  } else if (action == "corrupt") {
    rule.action = FaultAction::kCorrupt;
  } else if (action == "cut") {
    rule.action = FaultAction::kCut;
  } else if (action == "stall") {
    rule.action = FaultAction::kStall;
  } else {
    return RuleError(
        source, index, text,
        absl::StrCat("unknown action \"", action, "\" (expected drop, delay, dup, corrupt, cut or stall)"));
  }
  bool ops_set = false, for_set = false;
  uint8_t ops = 0;
  for (size_t i = 1; i < fields.size(); ++i) {
    const std::string& f = fields[i];
    const size_t eq = f.find('=');
    if (eq == std::string::npos) {
      for (absl::string_view op : absl::StrSplit(f, '+')) {
        if (op == "send") {
          ops |= kFaultSend;
        } else if (op == "recv" || op == "receive") {
          ops |= kFaultReceive;
        } else if (op == "write") {
          ops |= kFaultWrite;
        } else if (op == "any") {
          ops |= kFaultAnyOp;
        } else {
          return RuleError(source, index, text,
                           absl::StrCat("unknown field \"", f,
                                        "\" (expected send, recv, write, any, or peer=, after=, at=, count=, "
                                        "prob=, for=, on=)"));
        }
      }
      ops_set = true;
      continue;
    }
    const std::string key = f.substr(0, eq), value = f.substr(eq + 1);
    auto bad = [&](const std::string& expected) {
      return RuleError(source, index, text, absl::StrCat(key, "=", value, ": expected ", expected));
    };
    if (key == "peer") {
      uint32_t p = 0;
      if (!absl::SimpleAtoi(value, &p)) return bad("a peer id (0, 1, ...)");
      rule.peer = p;
    } else if (key == "after") {
      if (!absl::SimpleAtoi(value, &rule.after)) return bad("a count of operations");
    } else if (key == "at") {
      if (!absl::ParseDuration(value, &rule.at) || rule.at < absl::ZeroDuration()) {
        return bad("a duration such as 500ms or 3s");
      }
    } else if (key == "count") {
      if (value == "all") {
        rule.count = kFaultCountAll;
      } else if (!absl::SimpleAtoi(value, &rule.count) || rule.count == 0) {
        return bad("a count >= 1 or all");
      }
    } else if (key == "prob") {
      if (!absl::SimpleAtod(value, &rule.probability) ||
          !(rule.probability > 0.0 && rule.probability <= 1.0)) {
        return bad("a probability in (0, 1]");
      }
    } else if (key == "for") {
      if (!absl::ParseDuration(value, &rule.duration) || rule.duration <= absl::ZeroDuration() ||
          rule.duration > absl::Hours(24)) {
        return bad("a duration in (0, 24h] such as 500ms or 3s");
      }
      for_set = true;
    } else {
      return RuleError(
          source, index, text,
          absl::StrCat("unknown key \"", key, "\" (expected peer, after, at, count, prob, for or on)"));
    }
  }
  if (ops_set) rule.ops = ops;
  const bool timed = rule.action == FaultAction::kDelay || rule.action == FaultAction::kStall;
  if (timed && !for_set) return RuleError(source, index, text, absl::StrCat(action, " needs for=DURATION"));
  if (!timed && for_set) return RuleError(source, index, text, absl::StrCat(action, " takes no for="));
  const bool per_peer = rule.action == FaultAction::kCut || rule.action == FaultAction::kStall;
  if (per_peer && !rule.peer) return RuleError(source, index, text, absl::StrCat(action, " needs peer=N"));
  return rule;
}

// splitmix64: the one source of random choices, advanced once per draw.
uint64_t NextRandom(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

class FaultTransport final : public Transport {
 public:
  FaultTransport(std::unique_ptr<Transport> inner, FaultSpec spec)
      : inner_(std::move(inner)), spec_(std::move(spec)), rng_(spec_.seed), start_(absl::Now()) {
    rules_.resize(spec_.rules.size());
  }

  const Capabilities& capabilities() const override { return inner_->capabilities(); }
  std::string address() const override { return inner_->address(); }
  absl::StatusOr<PeerId> Connect(const std::string& address) override { return inner_->Connect(address); }
  absl::StatusOr<PeerId> Accept(absl::Time deadline) override { return inner_->Accept(deadline); }
  std::string PeerName(PeerId peer) const override { return inner_->PeerName(peer); }
  absl::Status RegisterBuffer(uint32_t id, void* base, size_t bytes) override {
    return inner_->RegisterBuffer(id, base, bytes);
  }
  uint64_t Doorbell(uint32_t buffer) const override { return inner_->Doorbell(buffer); }
  void Close(PeerId peer) override { inner_->Close(peer); }
  void Reopen(PeerId peer) override { inner_->Reopen(peer); }
  bool Connecting(PeerId peer) const override { return inner_->Connecting(peer); }

  absl::Status Send(PeerId peer, absl::Span<const uint8_t> message) override {
    RETURN_IF_ERROR(Pump());
    RETURN_IF_ERROR(CheckCut(peer));
    Outgoing op{.peer = peer, .is_write = false};
    op.bytes.assign(message.begin(), message.end());
    return Out(kFaultSend, std::move(op));
  }

  absl::Status Write(PeerId peer, uint32_t buffer, uint64_t offset,
                     absl::Span<const absl::Span<const uint8_t>> pieces, uint64_t seqno) override {
    RETURN_IF_ERROR(Pump());
    RETURN_IF_ERROR(CheckCut(peer));
    Outgoing op{.peer = peer, .is_write = true, .buffer = buffer, .offset = offset, .seqno = seqno};
    for (absl::Span<const uint8_t> p : pieces) op.bytes.insert(op.bytes.end(), p.begin(), p.end());
    return Out(kFaultWrite, std::move(op));
  }

  absl::Status Receive(PeerId* from, std::vector<uint8_t>* message, absl::Time deadline) override {
    while (true) {
      RETURN_IF_ERROR(Pump());
      if (!cut_reports_.empty()) {
        const PeerId p = cut_reports_.front();
        cut_reports_.pop_front();
        return CutError(p);
      }
      if (TakeHeld(from, message)) return absl::OkStatus();
      const absl::Time now = absl::Now();
      if (now >= deadline) return Expired(last_inner_status_, "a control message");
      PeerId p = 0;
      std::vector<uint8_t> m;
      absl::Status s = inner_->Receive(&p, &m, std::min(deadline, now + kSlice));
      if (absl::IsDeadlineExceeded(s)) {
        last_inner_status_ = s;
        continue;
      }
      RETURN_IF_ERROR(s);
      if (cut_.count(p) != 0) continue;  // discarded: the connection is gone for this side
      Fired f = Decide(kFaultReceive, p);
      if (f.cut) {
        Cut(p);
        return CutError(p);
      }
      if (f.drop) continue;
      if (f.corrupt) Corrupt(&m);
      const absl::Time ready = absl::Now() + f.delay;
      if (f.dup) held_.push_back({p, m, ready});
      held_.push_back({p, std::move(m), ready});
    }
  }

  absl::Status WaitDoorbell(uint32_t buffer, uint64_t seqno, absl::Time deadline) override {
    while (true) {
      RETURN_IF_ERROR(Pump());
      const absl::Time now = absl::Now();
      if (now >= deadline)
        return Expired(last_inner_status_, absl::StrCat("doorbell ", seqno, " of buffer ", buffer));
      absl::Status s = inner_->WaitDoorbell(buffer, seqno, std::min(deadline, now + kSlice));
      if (!absl::IsDeadlineExceeded(s)) return s;
      last_inner_status_ = s;
    }
  }

  absl::Status Flush(absl::Time deadline) override {
    while (true) {
      RETURN_IF_ERROR(Pump());
      bool queued = false;
      for (const auto& [peer, q] : queued_) queued = queued || !q.empty();
      if (!queued) break;
      if (absl::Now() >= deadline) return Expired(absl::OkStatus(), "the sends and writes held by a stall");
      absl::SleepFor(std::min(kSlice, deadline - absl::Now()));
    }
    return inner_->Flush(deadline);
  }

  absl::Status EnqueueWrite(PeerId peer, uint32_t buffer, uint64_t offset, const void* src, size_t bytes,
                            uint64_t seqno, void* stream) override {
    RETURN_IF_ERROR(CheckCut(peer));
    return inner_->EnqueueWrite(peer, buffer, offset, src, bytes, seqno, stream);
  }
  absl::Status EnqueueWait(PeerId peer, uint32_t buffer, uint64_t offset, size_t bytes, uint64_t seqno,
                           absl::Duration timeout, const std::string& label, void* stream) override {
    return inner_->EnqueueWait(peer, buffer, offset, bytes, seqno, timeout, label, stream);
  }
  void SetDeviceChecksums(bool on) override { inner_->SetDeviceChecksums(on); }
  absl::Status SyncStream(void* stream, absl::Time deadline) override {
    return inner_->SyncStream(stream, deadline);
  }
  void SetDevicePoll(std::function<absl::Status()> poll) override { inner_->SetDevicePoll(std::move(poll)); }
  absl::Status ResetDevicePath(void* stream) override { return inner_->ResetDevicePath(stream); }

 private:
  struct Outgoing {
    PeerId peer = 0;
    bool is_write = false;
    uint32_t buffer = 0;
    uint64_t offset = 0;
    uint64_t seqno = 0;
    std::vector<uint8_t> bytes;
  };
  struct Held {
    PeerId peer;
    std::vector<uint8_t> message;
    absl::Time ready;
  };
  struct RuleState {
    uint64_t matched = 0;  // matching operations seen
    uint64_t fired = 0;
  };
  // What the rules decided for one operation.
  struct Fired {
    bool drop = false, dup = false, corrupt = false, cut = false;
    absl::Duration delay = absl::ZeroDuration();
  };

  std::string Peer(PeerId p) const { return absl::StrCat("peer ", p, " (", inner_->PeerName(p), ")"); }

  absl::Status CutError(PeerId p) const {
    return absl::UnavailableError(absl::StrCat(Peer(p), ": connection cut by fault injection"));
  }
  absl::Status CheckCut(PeerId p) const { return cut_.count(p) != 0 ? CutError(p) : absl::OkStatus(); }

  void Cut(PeerId p) {
    cut_.insert(p);
    queued_.erase(p);
    stalled_until_.erase(p);
    std::erase_if(held_, [p](const Held& h) { return h.peer == p; });
  }

  bool Stalled(PeerId p) const {
    auto it = stalled_until_.find(p);
    return it != stalled_until_.end() && absl::Now() < it->second;
  }

  // A DeadlineExceeded for `what`, naming every peer stalled now.
  absl::Status Expired(const absl::Status& inner, const std::string& what) const {
    std::vector<std::string> stalled;
    for (const auto& [p, until] : stalled_until_) {
      if (absl::Now() < until)
        stalled.push_back(absl::StrCat(Peer(p), " stalled by fault injection for another ",
                                       absl::FormatDuration(until - absl::Now())));
    }
    std::string base =
        inner.ok() ? absl::StrCat("no ", what, " before the deadline") : std::string(inner.message());
    if (!stalled.empty()) absl::StrAppend(&base, " (", absl::StrJoin(stalled, "; "), ")");
    return absl::DeadlineExceededError(base);
  }

  void Log(const FaultRule& rule, uint8_t op, PeerId peer) const {
    TANDEM_LOG_WARN("faults", "injected ", ActionName(rule.action), " on ", OpName(op), " of ", Peer(peer),
                    " (rule \"", rule.text, "\")");
  }

  void FireStall(const FaultRule& rule, PeerId peer) { stalled_until_[peer] = absl::Now() + rule.duration; }

  // Counts the operation against every rule that matches it and applies the ones that fire.
  Fired Decide(uint8_t op, PeerId peer) {
    Fired f;
    const absl::Duration elapsed = absl::Now() - start_;
    for (size_t i = 0; i < spec_.rules.size(); ++i) {
      const FaultRule& rule = spec_.rules[i];
      RuleState& st = rules_[i];
      if ((rule.ops & op) == 0 || (rule.peer && *rule.peer != peer)) continue;
      const uint64_t index = st.matched++;
      if (index < rule.after || elapsed < rule.at || st.fired >= rule.count) continue;
      if (rule.probability < 1.0 &&
          static_cast<double>(NextRandom(&rng_) >> 11) * 0x1.0p-53 >= rule.probability) {
        continue;
      }
      ++st.fired;
      Log(rule, op, peer);
      switch (rule.action) {
        case FaultAction::kDrop:
          f.drop = true;
          break;
        case FaultAction::kDelay:
          f.delay += rule.duration;
          break;
        case FaultAction::kDuplicate:
          f.dup = true;
          break;
        case FaultAction::kCorrupt:
          f.corrupt = true;
          break;
        case FaultAction::kCut:
          f.cut = true;
          break;
        case FaultAction::kStall:
          FireStall(rule, peer);
          break;
      }
    }
    return f;
  }

  void Corrupt(std::vector<uint8_t>* bytes) {
    if (bytes->empty()) return;
    const size_t at = NextRandom(&rng_) % bytes->size();
    (*bytes)[at] ^= static_cast<uint8_t>(1 + NextRandom(&rng_) % 255);
  }

  absl::Status Forward(const Outgoing& op) {
    if (!op.is_write) return inner_->Send(op.peer, op.bytes);
    const absl::Span<const uint8_t> piece(op.bytes);
    return inner_->Write(op.peer, op.buffer, op.offset, absl::MakeConstSpan(&piece, 1), op.seqno);
  }

  absl::Status Out(uint8_t kind, Outgoing op) {
    const PeerId peer = op.peer;
    Fired f = Decide(kind, peer);
    if (f.cut) {
      Cut(peer);
      cut_reports_.push_back(peer);
      return CutError(peer);
    }
    if (f.drop) return absl::OkStatus();
    if (f.corrupt) Corrupt(&op.bytes);
    if (f.delay > absl::ZeroDuration()) absl::SleepFor(f.delay);
    if (Stalled(peer) || !queued_[peer].empty()) {
      if (f.dup) queued_[peer].push_back(op);
      queued_[peer].push_back(std::move(op));
      return absl::OkStatus();
    }
    if (f.dup) RETURN_IF_ERROR(Forward(op));
    return Forward(op);
  }

  // The next held message that may be delivered: ready, its peer not stalled, and no earlier held
  // message of the same peer still waiting (per-peer order).
  bool TakeHeld(PeerId* from, std::vector<uint8_t>* message) {
    const absl::Time now = absl::Now();
    std::set<PeerId> blocked;
    for (auto it = held_.begin(); it != held_.end(); ++it) {
      if (blocked.count(it->peer) != 0) continue;
      if (it->ready > now || Stalled(it->peer)) {
        blocked.insert(it->peer);
        continue;
      }
      *from = it->peer;
      *message = std::move(it->message);
      held_.erase(it);
      return true;
    }
    return false;
  }

  // Fires timed cut and stall rules, and sends what ended stalls released, in order.
  absl::Status Pump() {
    const absl::Duration elapsed = absl::Now() - start_;
    for (size_t i = 0; i < spec_.rules.size(); ++i) {
      const FaultRule& rule = spec_.rules[i];
      RuleState& st = rules_[i];
      const bool timed = (rule.action == FaultAction::kCut || rule.action == FaultAction::kStall) &&
                         rule.after == 0 && rule.at > absl::ZeroDuration();
      if (!timed || st.fired > 0 || elapsed < rule.at) continue;
      ++st.fired;
      Log(rule, rule.ops, *rule.peer);
      if (rule.action == FaultAction::kCut) {
        Cut(*rule.peer);
        cut_reports_.push_back(*rule.peer);
      } else {
        FireStall(rule, *rule.peer);
      }
    }
    for (auto& [peer, q] : queued_) {
      if (Stalled(peer)) continue;
      while (!q.empty()) {
        Outgoing op = std::move(q.front());
        q.pop_front();
        RETURN_IF_ERROR(Forward(op));
      }
    }
    return absl::OkStatus();
  }

  std::unique_ptr<Transport> inner_;
  FaultSpec spec_;
  std::vector<RuleState> rules_;
  uint64_t rng_;
  absl::Time start_;
  std::set<PeerId> cut_;
  std::deque<PeerId> cut_reports_;  // cuts the next Receive reports
  std::map<PeerId, absl::Time> stalled_until_;
  std::map<PeerId, std::deque<Outgoing>> queued_;  // held by a stall, in order
  std::deque<Held> held_;                          // received, not yet delivered
  absl::Status last_inner_status_ = absl::OkStatus();
};

}  // namespace

absl::StatusOr<FaultSpec> ParseFaultSpec(std::string_view text, std::string_view source) {
  FaultSpec spec;
  size_t index = 0;
  for (absl::string_view item : absl::StrSplit(ToAbsl(text), ';')) {
    item = absl::StripAsciiWhitespace(item);
    if (item.empty()) continue;
    if (absl::ConsumePrefix(&item, "seed=")) {
      if (!absl::SimpleAtoi(item, &spec.seed)) {
        return absl::InvalidArgumentError(
            absl::StrCat(ToAbsl(source), ": seed=", item, ": expected an unsigned integer"));
      }
      continue;
    }
    ASSIGN_OR_RETURN(FaultRule rule, ParseRule(source, index, std::string_view(item.data(), item.size())));
    spec.rules.push_back(std::move(rule));
    ++index;
  }
  return spec;
}

FaultSpec FaultSpecForProcess(const FaultSpec& spec, std::string_view process_tag) {
  FaultSpec out{.seed = spec.seed, .rules = {}};
  for (const FaultRule& r : spec.rules) {
    if (r.process.empty() || r.process == process_tag) out.rules.push_back(r);
  }
  return out;
}

std::unique_ptr<Transport> WrapWithFaults(std::unique_ptr<Transport> inner, FaultSpec spec) {
  return std::make_unique<FaultTransport>(std::move(inner), std::move(spec));
}

absl::StatusOr<std::unique_ptr<Transport>> WrapWithFaultsFromEnvironment(std::unique_ptr<Transport> inner) {
  const char* env = std::getenv(kFaultsEnvVar);
  if (env == nullptr || *env == '\0') return inner;
  ASSIGN_OR_RETURN(FaultSpec all, ParseFaultSpec(env, kFaultsEnvVar));
  const std::string tag = LogProcessTag();
  FaultSpec here = FaultSpecForProcess(all, tag);
  if (here.rules.empty()) return inner;
  TANDEM_LOG_WARN("faults", kFaultsEnvVar, " injects faults into this process's ", inner->capabilities().name,
                  " transport: ", here.rules.size(), " rule(s) of \"", env, "\" apply to ", tag);
  return WrapWithFaults(std::move(inner), std::move(here));
}

}  // namespace tandem::transport
