// The order in which a process sets up its NCCL communicators with its peers, agreed with them
// without a coordinator (no CUDA, no NCCL: the NCCL transport drives it, tests simulate it).
//
// Why an order is needed. Setting up a pair of 2-rank communicators is collective: both processes
// must run it at once, and each process runs one set-up at a time (nccl_internal.h says why). If
// every process simply started whichever peer was ready first, three processes that all connect to
// each other could each start a different pair (A with B, B with C, C with A) and wait for their
// partner until the set-up timeout.
//
// The protocol. Every process draws a random 64-bit key and sends it in its hello. Of two peers, the
// one with the smaller key leads their set-up. A process with no set-up running (idle) either
//   - accepts a proposal: a peer that leads their pair has asked to start; the process answers
//     "go" and starts the set-up at once (it runs; the leader starts on receiving "go"), or
//   - proposes: it leads the pair with a peer whose hello it has, sends "propose", and commits
//     to that pair until the peer's "go" arrives (it accepts nothing else meanwhile).
// Proposals are accepted first, so a committed leader waits as little as possible.
//
// No deadlock. A process waits on another only as a committed leader waiting for its follower's
// "go", and the follower's key is larger. A follower that is idle accepts some proposal (not
// necessarily ours; then the set-up it starts runs, both sides committed, and finishes); one that
// is running a set-up it accepted finishes it; one that is itself a committed leader waits on a
// process of a still larger key. Keys only grow along a chain of waits, so every chain ends in a
// process that makes progress, and every proposal is eventually accepted.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tandem::transport::nccl_internal {

template <typename PeerId>
class SetupTurns {
 public:
  enum class Action : uint8_t {
    kPropose,  // send "propose" to the peer and wait for its "go" (this side leads)
    kGo,       // send "go" to the peer and start the set-up now (the peer leads)
    kStart,    // the peer's "go" arrived: start the set-up now (this side leads)
  };
  struct Turn {
    Action action;
    PeerId peer;
  };

  explicit SetupTurns(uint64_t key) : key_(key) {}
  uint64_t key() const { return key_; }

  // The peer's hello, with its key: its set-up may be taken in turn.
  absl::Status Hello(PeerId peer, uint64_t their_key) {
    if (their_key == key_) {
      return absl::FailedPreconditionError(absl::StrCat("both sides of a connection drew the set-up key ",
                                                        key_, " (a connection to itself?)"));
    }
    State& s = peers_[peer];
    s.known = true;
    s.leader = key_ < their_key;
    return absl::OkStatus();
  }
  // The peer (which leads) proposed to start.
  absl::Status Proposed(PeerId peer) {
    State& s = peers_[peer];
    if (s.known && s.leader) return absl::DataLossError("a proposal from a peer this side leads");
    if (s.proposed || s.phase != Phase::kWaiting) return absl::DataLossError("a second proposal");
    s.proposed = true;
    return absl::OkStatus();
  }
  // The peer (which follows) answered our proposal.
  absl::Status Go(PeerId peer) {
    auto it = peers_.find(peer);
    if (it == peers_.end() || it->second.phase != Phase::kProposed || current_ != peer) {
      return absl::DataLossError("a \"go\" without a proposal");
    }
    it->second.go = true;
    return absl::OkStatus();
  }
  // The set-up with `peer` has ended (done or failed), or the peer is gone: the process is idle
  // again if it was committed to that peer.
  void Ended(PeerId peer) {
    peers_[peer].phase = Phase::kEnded;
    if (current_ == peer) current_.reset();
  }

  // What to do next, if anything; call when no NCCL job is in flight. The returned action is
  // recorded as taken.
  std::optional<Turn> Next() {
    if (current_) {
      State& s = peers_.at(*current_);
      if (s.phase == Phase::kProposed && s.go) {
        s.phase = Phase::kRunning;
        return Turn{Action::kStart, *current_};
      }
      return std::nullopt;
    }
    for (auto& [peer, s] : peers_) {
      if (s.known && !s.leader && s.proposed && s.phase == Phase::kWaiting) {
        s.phase = Phase::kRunning;
        current_ = peer;
        return Turn{Action::kGo, peer};
      }
    }
    for (auto& [peer, s] : peers_) {
      if (s.known && s.leader && s.phase == Phase::kWaiting) {
        s.phase = Phase::kProposed;
        current_ = peer;
        return Turn{Action::kPropose, peer};
      }
    }
    return std::nullopt;
  }

  // The peer this process is committed to (proposed to, or setting up with), if any.
  std::optional<PeerId> current() const { return current_; }
  // Whether a set-up with `peer` is still to come or in flight.
  bool Pending(PeerId peer) const {
    auto it = peers_.find(peer);
    return it != peers_.end() && it->second.phase != Phase::kEnded;
  }
  // For error messages: what the set-up with `peer` waits for.
  std::string Describe(PeerId peer) const {
    auto it = peers_.find(peer);
    if (it == peers_.end() || !it->second.known) return "no hello from the peer yet";
    const State& s = it->second;
    switch (s.phase) {
      case Phase::kWaiting:
        if (current_) return "waiting for this side's set-up with another peer";
        return s.leader ? "waiting for its turn" : "waiting for the peer to propose";
      case Phase::kProposed:
        return "proposed; waiting for the peer's answer (it is setting up with another peer)";
      case Phase::kRunning:
        return "running";
      case Phase::kEnded:
        return "ended";
    }
    return "?";
  }

 private:
  enum class Phase : uint8_t { kWaiting, kProposed, kRunning, kEnded };
  struct State {
    bool known = false;     // the peer's hello (and key) arrived
    bool leader = false;    // this side's key is the smaller
    bool proposed = false;  // the peer proposed (it leads)
    bool go = false;        // the peer answered our proposal
    Phase phase = Phase::kWaiting;
  };

  uint64_t key_;
  std::map<PeerId, State> peers_;
  std::optional<PeerId> current_;
};

}  // namespace tandem::transport::nccl_internal
