// The connection state machine of one reliable-connected (RC) queue pair of the verbs transport:
// RESET -> INIT -> RTR -> RTS, and an error state that any failure leads to and that nothing
// leaves. The attribute sets that ibv_modify_qp needs for each step are computed by pure
// functions from the local port and the peer's QpInfo (verbs_wire.h); the machine applies them
// through a callback (ibv_modify_qp in the transport, a recorder in the tests), so that the
// order of the steps, the masks and the values are tested without hardware.
//
// Choices (the same on both sides, so that neither needs to negotiate them):
//   INIT  pkey index 0, the configured port, remote write allowed (the only remote operation).
//   RTR   path MTU = the smaller of the two ports' active MTUs; the peer's QP number and first
//         PSN; max_dest_rd_atomic 1 and min_rnr_timer 12 (0.64 ms), neither of which matters
//         for RDMA WRITE but both of which the verbs require; the address vector names the
//         peer's LID, and its GID through a global route header when the link is Ethernet
//         (RoCE) or the peer has no LID.
//   RTS   our first PSN; timeout 14 (4.096 us * 2^14 = 67 ms per try), retry_cnt 7 and
//         rnr_retry 7 (the maximum), max_rd_atomic 1.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "common/transport/verbs/verbs_wire.h"

namespace tandem::transport::verbs {

enum class QpState : uint8_t { kReset, kInit, kRtr, kRts, kError };
const char* QpStateName(QpState state);

inline constexpr uint8_t kMinRnrTimer = 12;
inline constexpr uint8_t kTimeout = 14;
inline constexpr uint8_t kRetryCount = 7;
inline constexpr uint8_t kRnrRetry = 7;
inline constexpr uint8_t kMaxRdAtomic = 1;
inline constexpr uint8_t kMaxDestRdAtomic = 1;
inline constexpr uint8_t kHopLimit = 64;

// One ibv_modify_qp call.
struct QpModify {
  ibv_qp_attr attr{};
  int mask = 0;
};

// What this side knows about its own port beyond its QpInfo.
struct LocalPort {
  QpInfo info;            // our QP number, first PSN, LID, port, active MTU, GID
  uint8_t gid_index = 0;  // the GID table entry `info.gid` came from
  bool ethernet = false;  // link layer Ethernet (RoCE): addressing needs the GRH
};

QpModify InitModify(uint8_t port);
QpModify RtrModify(const LocalPort& local, const QpInfo& remote);
QpModify RtsModify(const LocalPort& local);
// Whether the address vector towards `remote` carries a global route header.
bool NeedsGrh(bool ethernet, const QpInfo& remote);

class QpStateMachine {
 public:
  // Applies one modification; returns 0 or an errno value, as ibv_modify_qp does.
  using Apply = std::function<int(ibv_qp_attr* attr, int mask)>;

  // `name` appears in every error ("QP to 10.0.0.2:4000").
  explicit QpStateMachine(std::string name) : name_(std::move(name)) {}

  QpState state() const { return state_; }
  // The failure that put the machine into the error state (OK otherwise).
  const absl::Status& error() const { return error_; }

  // RESET -> INIT.
  absl::Status ToInit(uint8_t port, const Apply& apply);
  // INIT -> RTR, once the peer's QpInfo is known (validated here: InvalidArgument naming the
  // field, which also fails the machine).
  absl::Status ToRtr(const LocalPort& local, const QpInfo& remote, const Apply& apply);
  // RTR -> RTS.
  absl::Status ToRts(const LocalPort& local, const Apply& apply);

  // Any state -> error, keeping the first reason. Later transitions are FailedPrecondition
  // carrying it.
  void Fail(const absl::Status& why);

 private:
  absl::Status Step(QpState from, QpState to, QpModify modify, const Apply& apply);

  std::string name_;
  QpState state_ = QpState::kReset;
  absl::Status error_;
};

}  // namespace tandem::transport::verbs
