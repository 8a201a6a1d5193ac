// The agreed order of NCCL communicator set-ups (common/transport/nccl/setup_turns.h), simulated:
// processes on random meshes exchange hellos, proposals and answers over per-link FIFO queues
// delivered in random order, and a set-up (an NCCL job) completes only once both of its processes
// run it, as NCCL's collective init does. Every pair must end set up, from every interleaving.
#include <gtest/gtest.h>

#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/transport/nccl/setup_turns.h"

namespace tandem::transport::nccl_internal {
namespace {

using Turns = SetupTurns<int>;

enum class Kind { kHello, kPropose, kGo };
struct Message {
  Kind kind;
  uint64_t key = 0;
};

struct Process {
  explicit Process(uint64_t key) : turns(key) {}
  Turns turns;
  std::optional<int> job;       // the peer of the NCCL job in flight
  std::set<int> started, done;  // peers whose set-up this process started / finished
  std::set<int> greeted;        // peers our hello went to
};

struct Mesh {
  std::vector<Process> procs;
  std::set<std::pair<int, int>> edges;                       // i < j
  std::map<std::pair<int, int>, std::deque<Message>> links;  // (from, to)
};

// Everything an event can change, to tell an event that did nothing.
std::string Snapshot(const Mesh& m) {
  std::string out;
  for (size_t i = 0; i < m.procs.size(); ++i) {
    const Process& p = m.procs[i];
    absl::StrAppend(&out, i, ":", p.job.value_or(-1), "/", p.turns.current().value_or(-1), "/");
    for (int g : p.greeted) absl::StrAppend(&out, "g", g);
    for (int s : p.started) absl::StrAppend(&out, "s", s);
    for (int d : p.done) absl::StrAppend(&out, "d", d);
    for (size_t j = 0; j < m.procs.size(); ++j)
      absl::StrAppend(&out, "|", p.turns.Describe(static_cast<int>(j)));
    out += ";";
  }
  for (const auto& [link, q] : m.links) {
    absl::StrAppend(&out, link.first, ">", link.second, ":");
    for (const Message& msg : q) absl::StrAppend(&out, static_cast<int>(msg.kind));
  }
  return out;
}

// Runs one random interleaving to quiescence; returns the pairs not set up on both sides.
std::vector<std::pair<int, int>> Simulate(Mesh& m, std::mt19937_64& rng) {
  while (true) {
    // Every enabled event, as a closure; one is drawn at random.
    std::vector<std::function<void()>> events;
    for (auto [a, b] : m.edges) {
      for (auto [from, to] : {std::pair{a, b}, std::pair{b, a}}) {
        Process& p = m.procs[from];
        if (!p.greeted.contains(to)) {
          events.push_back([&m, &p, from, to] {
            p.greeted.insert(to);
            m.links[{from, to}].push_back({Kind::kHello, p.turns.key()});
          });
        }
        auto& q = m.links[{from, to}];
        if (!q.empty()) {
          events.push_back([&m, &q, from, to] {
            const Message msg = q.front();
            q.pop_front();
            // As the control plane does: a peer met first in a receive is greeted before its
            // message is consumed.
            Process& receiver = m.procs[to];
            if (!receiver.greeted.contains(from)) {
              receiver.greeted.insert(from);
              m.links[{to, from}].push_back({Kind::kHello, receiver.turns.key()});
            }
            Turns& t = receiver.turns;
            absl::Status s;
            if (msg.kind == Kind::kHello) s = t.Hello(from, msg.key);
            if (msg.kind == Kind::kPropose) s = t.Proposed(from);
            if (msg.kind == Kind::kGo) s = t.Go(from);
            ASSERT_TRUE(s.ok()) << s;
          });
        }
      }
    }
    for (int i = 0; i < static_cast<int>(m.procs.size()); ++i) {
      Process& p = m.procs[i];
      if (!p.job) {
        events.push_back([&m, &p, i] {
          const std::optional<Turns::Turn> turn = p.turns.Next();
          if (!turn) return;
          // A process only takes turns with peers it has greeted (its hello carries its id).
          ASSERT_TRUE(p.greeted.contains(turn->peer));
          if (turn->action == Turns::Action::kPropose) {
            m.links[{i, turn->peer}].push_back({Kind::kPropose});
            return;
          }
          if (turn->action == Turns::Action::kGo) m.links[{i, turn->peer}].push_back({Kind::kGo});
          ASSERT_FALSE(p.started.contains(turn->peer)) << "a second set-up with one peer";
          p.started.insert(turn->peer);
          p.job = turn->peer;
        });
      } else {
        // The job completes once the partner runs (or has run) the same set-up.
        const int partner = *p.job;
        if (m.procs[partner].started.contains(i)) {
          events.push_back([&p, partner] {
            p.done.insert(partner);
            p.job.reset();
            p.turns.Ended(partner);
          });
        }
      }
    }
    // Drawing an event that does nothing (an idle process with no turn) must not loop forever:
    // stop when no event changes anything, judged by trying them all.
    bool progressed = false;
    std::shuffle(events.begin(), events.end(), rng);
    for (auto& e : events) {
      const auto before = Snapshot(m);
      e();
      if (::testing::Test::HasFatalFailure()) return {};
      if (Snapshot(m) != before) {
        progressed = true;
        break;
      }
    }
    if (!progressed) break;
  }
  std::vector<std::pair<int, int>> missing;
  for (auto [a, b] : m.edges) {
    if (!m.procs[a].done.contains(b) || !m.procs[b].done.contains(a)) missing.push_back({a, b});
  }
  return missing;
}

TEST(SetupTurnsTest, EveryPairOfARandomMeshIsSetUp) {
  std::mt19937_64 rng(20261128);
  for (int trial = 0; trial < 1500; ++trial) {
    const int n = 2 + static_cast<int>(rng() % 6);
    const double density = 0.3 + 0.7 * static_cast<double>(rng() % 1000) / 1000.0;
    Mesh m;
    std::set<uint64_t> keys;
    while (static_cast<int>(keys.size()) < n) keys.insert(1 + rng() % 1000);
    std::vector<uint64_t> order(keys.begin(), keys.end());
    std::shuffle(order.begin(), order.end(), rng);
    for (uint64_t k : order) m.procs.emplace_back(k);
    for (int a = 0; a < n; ++a) {
      for (int b = a + 1; b < n; ++b) {
        if (static_cast<double>(rng() % 1000) / 1000.0 < density) m.edges.insert({a, b});
      }
    }
    const auto missing = Simulate(m, rng);
    ASSERT_FALSE(::testing::Test::HasFatalFailure()) << "trial " << trial;
    ASSERT_TRUE(missing.empty()) << "trial " << trial << ": " << n << " processes, " << m.edges.size()
                                 << " connections; pair " << missing[0].first << "-" << missing[0].second
                                 << " never set up ("
                                 << m.procs[missing[0].first].turns.Describe(missing[0].second) << ")";
  }
}

TEST(SetupTurnsTest, RefusesWhatTheProtocolNeverSends) {
  Turns t(5);
  EXPECT_FALSE(t.Hello(1, 5).ok()) << "a peer with our own key";
  ASSERT_TRUE(t.Hello(2, 9).ok());  // we lead with 2
  EXPECT_FALSE(t.Proposed(2).ok()) << "a proposal from a peer we lead";
  EXPECT_FALSE(t.Go(2).ok()) << "an answer before our proposal";
  ASSERT_TRUE(t.Hello(3, 1).ok());  // 3 leads
  ASSERT_TRUE(t.Proposed(3).ok());
  EXPECT_FALSE(t.Proposed(3).ok()) << "a second proposal";
}

TEST(SetupTurnsTest, ProposalsAreAnsweredBeforeProposing) {
  Turns t(5);
  ASSERT_TRUE(t.Hello(2, 9).ok());  // we lead with 2
  ASSERT_TRUE(t.Hello(3, 1).ok());  // 3 leads
  ASSERT_TRUE(t.Proposed(3).ok());
  auto turn = t.Next();
  ASSERT_TRUE(turn.has_value());
  EXPECT_EQ(turn->action, Turns::Action::kGo);
  EXPECT_EQ(turn->peer, 3);
  EXPECT_FALSE(t.Next().has_value()) << "one set-up at a time";
  t.Ended(3);
  turn = t.Next();
  ASSERT_TRUE(turn.has_value());
  EXPECT_EQ(turn->action, Turns::Action::kPropose);
  EXPECT_EQ(turn->peer, 2);
  EXPECT_FALSE(t.Next().has_value()) << "committed until the answer";
  ASSERT_TRUE(t.Go(2).ok());
  turn = t.Next();
  ASSERT_TRUE(turn.has_value());
  EXPECT_EQ(turn->action, Turns::Action::kStart);
  EXPECT_EQ(turn->peer, 2);
}

TEST(SetupTurnsTest, AWithdrawnProposalFreesTheProcess) {
  Turns t(5);
  ASSERT_TRUE(t.Hello(2, 9).ok());
  ASSERT_TRUE(t.Hello(4, 7).ok());
  auto turn = t.Next();
  ASSERT_TRUE(turn.has_value());
  const int first = turn->peer;
  t.Ended(first);  // the peer is gone
  turn = t.Next();
  ASSERT_TRUE(turn.has_value());
  EXPECT_EQ(turn->action, Turns::Action::kPropose);
  EXPECT_NE(turn->peer, first);
  EXPECT_TRUE(t.Pending(turn->peer));
  EXPECT_FALSE(t.Pending(first));
}

}  // namespace
}  // namespace tandem::transport::nccl_internal
