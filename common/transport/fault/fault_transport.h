// A fault-injecting transport (docs/architecture.md, "Failures today"; README, "Failure model"):
// a Transport that wraps any other (ucx, local, ...) and, following a spec, drops, delays,
// duplicates or corrupts control messages and one-sided writes, cuts the connection to a peer or
// stalls a peer for a while. It is a testing aid: unit tests wrap a transport with
// WrapWithFaults, and real `tandem` processes misbehave when the environment variable
// TANDEM_FAULTS holds a spec (CreateTransport, common/transport/factory.h, wraps every transport
// it makes then).
//
// Spec: rules separated by ';' (whitespace around them ignored), each an action and ':'-separated
// fields; one item may instead be `seed=N` (default 1), the seed of every random choice.
//
//   corrupt:write:peer=1:after=40;stall:peer=0:after=100:for=3s;seed=7
//
//   action     what happens to an operation the rule fires on
//   ---------  ----------------------------------------------------------------------------------
//   drop       a send or write returns OK and nothing is sent (the peer's waits run out); a
//              received message is discarded
//   delay      the operation waits `for` first (a received message is held that long)
//   dup        sent, written or delivered twice (a write with the same seqno)
//   corrupt    one byte, chosen from the seed, is xor-ed with a nonzero value chosen from the seed
//              (the receiver's wire decoder refuses a control frame by its crc32c or header; a
//              host-staged layer payload by its crc when transport.checksums is on)
//   cut        the connection to `peer` is gone for this side: the firing operation and every
//              later Send, Write or EnqueueWrite to it fail with Unavailable naming the peer
//              ("... connection cut by fault injection"); the next Receive reports it the same
//              way once, and later messages from it are discarded. The peer's side is not told:
//              it sees silence, as across a network partition, and its deadlines fire
//   stall      for `for` from when it fires, this side's sends and writes to `peer` are held
//              (queued in order, sent when the stall ends) and its control messages from `peer`
//              are held likewise; a Receive, WaitDoorbell or Flush whose deadline passes during a
//              stall fails with DeadlineExceeded naming the stalled peer. Writes the peer made
//              into this side's buffers are not hidden (they land by themselves)
//
//   field      meaning (every field optional unless said)
//   ---------  ----------------------------------------------------------------------------------
//   send, recv, write, any   the operations the rule counts and acts on; combine with '+'
//              ("send+write"); default any. recv is the messages Receive returns
//   peer=N     only operations with PeerId N (this transport's numbering: Connect/Accept order;
//              compute rank 0 numbers memory rank m as m, a memory rank numbers compute rank 0 as
//              0); required for cut and stall
//   after=N    the first N matching operations pass untouched (default 0)
//   at=D       the rule arms D after the transport was made (an absl duration: 500ms, 3s); cut and
//              stall with at= and no after= fire at that time even with no operation
//   count=N    fires at most N times (default 1); count=all: on every armed operation
//   prob=P     each armed operation fires with probability P in (0, 1] (default 1), drawn from
//              the seed
//   for=D      delay and stall: how long (required for them)
//   on=TAG     only in the process whose log tag (common/log.h) is TAG: "compute:0", "memory:1"; so
//              one TANDEM_FAULTS can be set for every rank of a deployment. The last field: it
//              takes the rest of the rule (tags contain ':')
//
// Determinism: the decisions (which operation fires, which byte flips) depend only on the seed
// and the sequence of operations this side makes; rules with at= also on time.
// Faults apply to Send, Receive and Write (the host paths); the device path (EnqueueWrite,
// EnqueueWait, SyncStream, SetDevicePoll, ResetDevicePath) is passed through, except that
// EnqueueWrite to a cut peer fails.
// Every fault that fires is logged as a warning naming the rule, the operation and the peer.
//
// Thread safety: as Transport (none; one thread drives it).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/transport/transport.h"

namespace tandem::transport {

enum class FaultAction : uint8_t { kDrop, kDelay, kDuplicate, kCorrupt, kCut, kStall };

// Operation bits of FaultRule::ops.
inline constexpr uint8_t kFaultSend = 1;
inline constexpr uint8_t kFaultReceive = 2;
inline constexpr uint8_t kFaultWrite = 4;
inline constexpr uint8_t kFaultAnyOp = kFaultSend | kFaultReceive | kFaultWrite;
inline constexpr uint64_t kFaultCountAll = ~uint64_t{0};

struct FaultRule {
  FaultAction action = FaultAction::kDrop;
  uint8_t ops = kFaultAnyOp;
  std::optional<PeerId> peer;  // nullopt: every peer
  uint64_t after = 0;
  absl::Duration at = absl::ZeroDuration();
  uint64_t count = 1;  // kFaultCountAll: no limit
  double probability = 1.0;
  absl::Duration duration = absl::ZeroDuration();  // delay, stall
  std::string process;                             // "": every process; else a log tag
  std::string text;                                // the rule as written
};

struct FaultSpec {
  uint64_t seed = 1;
  std::vector<FaultRule> rules;
};

// Parses a spec (grammar above). InvalidArgument naming `source` (e.g. "TANDEM_FAULTS"), the
// rule's index and text and what is wrong: "TANDEM_FAULTS: rule 1 \"stall:peer=0\": stall needs
// for=DURATION". An empty spec has no rules.
absl::StatusOr<FaultSpec> ParseFaultSpec(std::string_view text, std::string_view source = "fault spec");

// `spec` without the rules whose on= names another process than `process_tag`.
FaultSpec FaultSpecForProcess(const FaultSpec& spec, std::string_view process_tag);

// `inner` behind the faults of `spec` (every rule applies; see FaultSpecForProcess).
std::unique_ptr<Transport> WrapWithFaults(std::unique_ptr<Transport> inner, FaultSpec spec);

// The environment variable the factory reads.
inline constexpr char kFaultsEnvVar[] = "TANDEM_FAULTS";

// When TANDEM_FAULTS is set and not empty: `inner` behind its rules for this process (its log
// tag, LogProcessTag()), logged once as a warning; `inner` itself when no rule applies here or the
// variable is unset. InvalidArgument naming TANDEM_FAULTS for a bad spec.
absl::StatusOr<std::unique_ptr<Transport>> WrapWithFaultsFromEnvironment(std::unique_ptr<Transport> inner);

}  // namespace tandem::transport
