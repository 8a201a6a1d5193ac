#include "common/transport/verbs/verbs_qp.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem::transport::verbs {

const char* QpStateName(QpState state) {
  switch (state) {
    case QpState::kReset:
      return "RESET";
    case QpState::kInit:
      return "INIT";
    case QpState::kRtr:
      return "RTR";
    case QpState::kRts:
      return "RTS";
    case QpState::kError:
      return "ERROR";
  }
  return "?";
}

QpModify InitModify(uint8_t port) {
  QpModify m;
  m.attr.qp_state = IBV_QPS_INIT;
  m.attr.pkey_index = 0;
  m.attr.port_num = port;
  m.attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
  m.mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  return m;
}

bool NeedsGrh(bool ethernet, const QpInfo& remote) { return ethernet || remote.lid == 0; }

QpModify RtrModify(const LocalPort& local, const QpInfo& remote) {
  QpModify m;
  m.attr.qp_state = IBV_QPS_RTR;
  m.attr.path_mtu = static_cast<ibv_mtu>(std::min(local.info.mtu, remote.mtu));
  m.attr.dest_qp_num = remote.qp_num;
  m.attr.rq_psn = remote.psn;
  m.attr.max_dest_rd_atomic = kMaxDestRdAtomic;
  m.attr.min_rnr_timer = kMinRnrTimer;
  m.attr.ah_attr.dlid = remote.lid;
  m.attr.ah_attr.sl = 0;
  m.attr.ah_attr.src_path_bits = 0;
  m.attr.ah_attr.port_num = local.info.port;
  if (NeedsGrh(local.ethernet, remote)) {
    m.attr.ah_attr.is_global = 1;
    std::memcpy(m.attr.ah_attr.grh.dgid.raw, remote.gid.data(), remote.gid.size());
    m.attr.ah_attr.grh.sgid_index = local.gid_index;
    m.attr.ah_attr.grh.hop_limit = kHopLimit;
    m.attr.ah_attr.grh.flow_label = 0;
    m.attr.ah_attr.grh.traffic_class = 0;
  }
  m.mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
           IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  return m;
}

QpModify RtsModify(const LocalPort& local) {
  QpModify m;
  m.attr.qp_state = IBV_QPS_RTS;
  m.attr.sq_psn = local.info.psn;
  m.attr.timeout = kTimeout;
  m.attr.retry_cnt = kRetryCount;
  m.attr.rnr_retry = kRnrRetry;
  m.attr.max_rd_atomic = kMaxRdAtomic;
  m.mask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
           IBV_QP_MAX_QP_RD_ATOMIC;
  return m;
}

absl::Status QpStateMachine::ToInit(uint8_t port, const Apply& apply) {
  if (port == 0 && state_ == QpState::kReset) {
    const absl::Status s = absl::InvalidArgumentError(absl::StrCat(name_, ": port 0 (ports count from 1)"));
    Fail(s);
    return s;
  }
  return Step(QpState::kReset, QpState::kInit, InitModify(port), apply);
}

absl::Status QpStateMachine::ToRtr(const LocalPort& local, const QpInfo& remote, const Apply& apply) {
  if (state_ == QpState::kInit) {
    absl::Status s = ValidateQpInfo(remote);
    if (s.ok()) s = ValidateQpInfo(local.info);
    if (!s.ok()) {
      s = Annotate(s, name_);
      Fail(s);
      return s;
    }
  }
  return Step(QpState::kInit, QpState::kRtr, RtrModify(local, remote), apply);
}

absl::Status QpStateMachine::ToRts(const LocalPort& local, const Apply& apply) {
  return Step(QpState::kRtr, QpState::kRts, RtsModify(local), apply);
}

void QpStateMachine::Fail(const absl::Status& why) {
  if (state_ == QpState::kError) return;
  state_ = QpState::kError;
  error_ = why.ok() ? absl::InternalError(absl::StrCat(name_, ": failed without a reason")) : why;
}

absl::Status QpStateMachine::Step(QpState from, QpState to, QpModify modify, const Apply& apply) {
  if (state_ == QpState::kError) {
    return absl::FailedPreconditionError(absl::StrCat(name_, ": cannot move to ", QpStateName(to),
                                                      " from the error state (", error_.message(), ")"));
  }
  if (state_ != from) {
    return absl::FailedPreconditionError(absl::StrCat(name_, ": cannot move to ", QpStateName(to), " from ",
                                                      QpStateName(state_), " (only from ", QpStateName(from),
                                                      ")"));
  }
  const int rc = apply(&modify.attr, modify.mask);
  if (rc != 0) {
    const absl::Status s =
        Annotate(ErrnoToStatus(rc, absl::StrCat("ibv_modify_qp(", QpStateName(to), ")")), name_);
    // A QP that refused a transition is unusable: the peer is gone for this transport.
    Fail(absl::UnavailableError(s.message()));
    return error_;
  }
  state_ = to;
  return absl::OkStatus();
}

}  // namespace tandem::transport::verbs
