// The local transport (docs/architecture.md, "Transports"): ranks that are threads of one process.
// It is how memory ranks share compute rank 0's GPU: one process holds one CUDA context, so the
// compute and attention kernels never wait for the GPU to switch between processes' contexts
// (measured in docs/benchmarks.md, "Disaggregated runtime on one GPU"), and activations move as
// device-to-device copies. On the CPU it is plain memory copies between threads.
//
// Addresses are "local:N", unique in the process; Connect finds the listener at once (a name no
// transport of this process listens on is Unavailable). Control messages are queued per
// receiving transport. Registered buffers are plain pointers (host memory, or device memory of any
// GPU in CUDA builds); a writer copies into the receiver's buffer, then sets its doorbell.
//
// Device path (CUDA builds): EnqueueWrite enqueues cudaMemcpyAsync into the peer's buffer on the
// caller's stream, records an event after it and hands the event to the peer (a signal: buffer,
// seqno, event); EnqueueWait waits on the host for the signal of that seqno (up to the wait's
// timeout, counted from the call) and makes the stream wait for the event. The host thus stays
// ahead of the GPU by about a layer, and no kernel spins. Events come from the writer's pool and
// return to it once the reader's stream waits on them. A signal that does not come, or a peer
// that goes away meanwhile, fails the device path (common/transport/device): later waits fall
// through and SyncStream reports it. Doorbell() reflects host-path writes only.
//
// A peer whose transport is destroyed without Close() is reported as Unavailable by the next
// Receive, WaitDoorbell, Send or write involving it; the memory behind its buffers is not touched
// after that. Thread safety: one thread drives each Transport; transports of one process may be
// driven by different threads.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/transport/transport.h"

namespace tandem::transport {

struct LocalOptions {
  int device = -1;  // the CUDA device of the caller's streams (device path); -1: CPU
};

absl::StatusOr<std::unique_ptr<Transport>> CreateLocalTransport(const LocalOptions& options);

}  // namespace tandem::transport
