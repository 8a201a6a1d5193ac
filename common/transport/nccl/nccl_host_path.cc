// The NCCL transport's host path: staged writes, receives posted as write frames arrive (see nccl_internal.h
// for the design).
#include "common/transport/nccl/nccl_internal.h"

namespace tandem::transport::nccl_internal {

// ---- host path ------------------------------------------------------------------------------------

absl::Status NcclTransport::Write(PeerId peer, uint32_t buffer, uint64_t offset,
                                  absl::Span<const absl::Span<const uint8_t>> pieces, uint64_t seqno) {
  if (seqno == 0) return absl::InvalidArgumentError("nccl transport: Write with seqno 0");
  ASSIGN_OR_RETURN(const uint64_t size, RemoteBytes(peer, buffer));
  uint64_t total = 0;
  for (const auto& piece : pieces) total += piece.size();
  const std::string& name = peers_.at(peer).name;
  if (offset > size || total > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat("nccl transport: write of ", total, " bytes at offset ",
                                                   offset, " outside buffer ", buffer, " (", size,
                                                   " bytes) of ", name));
  }
  ASSIGN_OR_RETURN(ncclComm_t comm, ReadyComm(peer, true));
  WriteFrame w;
  w.buffer = buffer;
  w.offset = offset;
  w.bytes = total;
  w.seqno = seqno;
  RETURN_IF_ERROR(control().Send(peer, ToBytes(w)));
  if (total == 0) return absl::OkStatus();

  NCCL_T_CUDA(cudaSetDevice(device_), name);
  RETURN_IF_ERROR(Grow(&staging_, &staging_bytes_, total, stream_));
  auto* at = static_cast<uint8_t*>(staging_);
  for (const auto& piece : pieces) {
    if (piece.empty()) continue;
    NCCL_T_CUDA(cudaMemcpyAsync(at, piece.data(), piece.size(), cudaMemcpyDefault, stream_),
                absl::StrCat("staging a write to ", name));
    at += piece.size();
  }
  RETURN_IF_ERROR(Issued(peer, true, ncclSend(staging_, total, ncclUint8, 1, comm, stream_), "ncclSend"));
  ASSIGN_OR_RETURN(cudaEvent_t done, RecordEvent(stream_, name));
  // Until the send has completed (the pieces are staged by then, the staging free again). Meanwhile
  // the peer's own writes to us are received, so that writes in both directions complete.
  const absl::Time start = absl::Now();
  while (true) {
    const cudaError_t q = cudaEventQuery(done);
    if (q == cudaSuccess) {
      ReleaseEvent(done);
      return absl::OkStatus();
    }
    absl::Status s;
    if (q != cudaErrorNotReady) {
      (void)cudaGetLastError();
      s = CudaError(q, "cudaEventQuery", absl::StrCat("a write to ", name));
    }
    if (s.ok()) s = Progress(kPump);
    if (s.ok()) s = CommOf(peer, true).failure;
    if (s.ok() && absl::Now() - start > kHostWriteTimeout) {
      s = absl::DeadlineExceededError(absl::StrCat("nccl transport: ", name, " did not receive the write of ",
                                                   total, " bytes to its buffer ", buffer, " (seqno ", seqno,
                                                   ") within ", absl::FormatDuration(kHostWriteTimeout)));
    }
    if (!s.ok()) {
      (void)FailComm(peer, true, s, false);  // the send kernel returns
      Drain(done, kDrainTimeout);
      cudaEventDestroy(done);
      return s;
    }
  }
}

absl::Status NcclTransport::WaitDoorbell(uint32_t buffer, uint64_t seqno, absl::Time deadline) {
  auto it = local_.find(buffer);
  if (it == local_.end()) return absl::NotFoundError(absl::StrCat("nccl transport: no buffer ", buffer));
  while (true) {
    if (it->second.doorbell >= seqno) return absl::OkStatus();
    if (!errors_.empty()) return TakeError();
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("nccl transport: waiting for doorbell ", seqno,
                                                      " of buffer ", buffer, " (it is at ",
                                                      it->second.doorbell, ")"));
    }
    RETURN_IF_ERROR(Progress(WaitFor(deadline)));
  }
}

absl::Status NcclTransport::Flush(absl::Time deadline) {
  NCCL_T_CUDA(cudaSetDevice(device_), "");
  while (true) {
    const cudaError_t q = cudaStreamQuery(stream_);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) {
      (void)cudaGetLastError();
      return CudaError(q, "cudaStreamQuery", "Flush");
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError("nccl transport: Flush did not complete before the deadline");
    }
    RETURN_IF_ERROR(Progress(kPump));
  }
  return control().Flush(deadline);
}

}  // namespace tandem::transport::nccl_internal
