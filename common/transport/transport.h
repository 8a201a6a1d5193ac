// The transport interface (docs/architecture.md, "Transports"): how one rank's process reaches the others.
//
// Two kinds of traffic share it:
//   * control messages: whole byte strings (step plans, hello, release, ...), delivered in order
//     per peer, received from any peer;
//   * one-sided writes into registered buffers, each followed by a doorbell: the writer puts
//     bytes at an offset of a buffer the receiver registered under a small id, then sets that
//     buffer's doorbell to a sequence number. A receiver that sees the doorbell at `seqno` sees
//     every byte written before it. This is the per-layer data path; the GPU transports (peer
//     writes, NCCL, GPUDirect RDMA) implement the same contract with device-side polling.
//
// Connections are made from an out-of-band descriptor (address()) that the launcher passes
// between processes; Connect() does not block (the first operations queue until wire-up), and the
// listening side learns of a peer through Accept().
//
// Nothing a peer sends is trusted: a write outside a registered buffer, to an unknown buffer id,
// or a malformed transport header is refused and reported (DataLoss naming the peer, buffer,
// offset and length) by the next WaitDoorbell/Receive; the data is dropped.
//
// Errors: every wait has a deadline (DeadlineExceeded naming what was awaited and from whom, with
// the doorbell value seen); a peer that disconnects or fails makes pending and later operations
// involving it fail with Unavailable naming the peer.
//
// Thread safety: none. One thread drives a Transport; all progress (delivering incoming writes
// and messages, completing sends) happens inside its calls.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace tandem::transport {

// A connection to one peer, numbered by this Transport (0, 1, 2, ... in order of Connect/Accept).
using PeerId = uint32_t;

struct Capabilities {
  std::string name;             // "ucx"
  bool gpu_memory = false;      // registered buffers may live in device memory
  bool device_polling = false;  // a kernel can wait on a doorbell
  bool same_host_only = false;  // peers must be processes of this host
  // A failed device path can be made usable again once its stream has drained (ResetDevicePath),
  // so that a failed step can run again.
  bool device_path_reset = false;
  // A peer connected at any time (Connect, Accept) gets its device connection through the control
  // connection, with no collective set-up among all peers: at once (p2p: the greeting carries the
  // doorbells and every buffer's IPC handle), or once Connecting() turns false (nccl: the pair of
  // communicators the hellos name, set up between the caller's steps). What a memory rank that
  // rejoins on a device path needs.
  bool device_path_new_peers = false;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const Capabilities& capabilities() const = 0;

  // The descriptor peers pass to Connect() to reach this process, e.g. "127.0.0.1:40123"; empty
  // if this transport does not listen.
  virtual std::string address() const = 0;
  // Starts a connection to the process listening at `address` and returns at once.
  // InvalidArgument for a malformed address; a refused or failed connection surfaces as
  // Unavailable from the next operation on the peer.
  virtual absl::StatusOr<PeerId> Connect(const std::string& address) = 0;
  // Waits for the next incoming connection. FailedPrecondition if not listening.
  virtual absl::StatusOr<PeerId> Accept(absl::Time deadline) = 0;
  // Human-readable name of a peer for messages ("127.0.0.1:40123").
  virtual std::string PeerName(PeerId peer) const = 0;

  // Control messages (1 byte to 1 GiB). Send returns once `message` may be reused.
  virtual absl::Status Send(PeerId peer, absl::Span<const uint8_t> message) = 0;
  // The next message from any peer, in arrival order (per peer: in send order).
  virtual absl::Status Receive(PeerId* from, std::vector<uint8_t>* message, absl::Time deadline) = 0;

  // Lets peers write into [base, base + bytes) as buffer `id`, whose doorbell starts at 0. Host
  // memory unless capabilities().gpu_memory. The memory must stay valid while the transport
  // lives. AlreadyExists if `id` is taken.
  virtual absl::Status RegisterBuffer(uint32_t id, void* base, size_t bytes) = 0;
  // Writes the concatenation of `pieces` at `offset` of the peer's buffer `buffer`, then sets its
  // doorbell to `seqno` (> 0, larger than any earlier seqno for that buffer). Returns once the
  // pieces may be reused (not necessarily once delivered). One writer per remote buffer. Pieces
  // in device memory (GPU transports) must be complete: the transport's own stream does not wait
  // for the caller's streams (synchronize them first; the device path orders by stream instead).
  virtual absl::Status Write(PeerId peer, uint32_t buffer, uint64_t offset,
                             absl::Span<const absl::Span<const uint8_t>> pieces, uint64_t seqno) = 0;
  // Waits until the doorbell of local buffer `buffer` is >= `seqno`. NotFound for an unknown id.
  virtual absl::Status WaitDoorbell(uint32_t buffer, uint64_t seqno, absl::Time deadline) = 0;
  // Current doorbell value of a local buffer (0 if unknown).
  virtual uint64_t Doorbell(uint32_t buffer) const = 0;

  // Waits until every operation started so far has completed (or failed) at the transport level.
  virtual absl::Status Flush(absl::Time deadline) = 0;

  // This side is done with `peer` (after a clean goodbye, or after giving it up as failed): its
  // disconnect is expected from now on and is logged at debug level instead of as a warning, and its
  // failure no longer fails waits on other peers. Operations on the peer still work until it goes,
  // and then fail with Unavailable as before.
  virtual void Close(PeerId peer) = 0;
  // OK while `peer` is usable as far as this transport knows; else the error its operations
  // return (Unavailable naming it: disconnected, failed, or a send to it that did not complete
  // within the send timeout). Lets a caller that got an error from a wait name the failed peer.
  virtual absl::Status PeerStatus(PeerId peer) const {
    (void)peer;
    return absl::OkStatus();
  }
  // Whether the connection that Connect() started to `peer` is still being set up (its bootstrap
  // has not finished, nor failed): an operation on the peer would first wait for that, up to the
  // transport's connect timeout. A caller that must not block (a probe of an address that may be
  // refused, or may be a stopped process) polls this before its first operation. Progress happens
  // inside the transport's other calls.
  virtual bool Connecting(PeerId peer) const {
    (void)peer;
    return false;
  }
  // Undoes Close(): from now on the peer's failure fails waits on other peers again, and its
  // disconnect is a warning. For a connection Close()d from the start (a probe, whose refusal must
  // fail nothing else) that turned out to be a live peer.
  virtual void Reopen(PeerId peer) { (void)peer; }

  // ---- The device data path (capabilities().device_polling) ------------------------------------
  // Work enqueued on one of the caller's CUDA streams (a cudaStream_t, passed as void* so that
  // this header stays CUDA-free), in stream order with the caller's kernels. A rank enqueues a
  // whole step this way (per layer: wait for the input -> compute -> write the output) and then
  // waits once, so no CPU is on the per-layer path. Registered buffers are device memory of the
  // transport's GPU. Transports without a device path return Unimplemented.

  // Enqueues the write of `bytes` at `src` (device memory of this process's GPU) to `offset` of
  // the peer's buffer `buffer`, then the doorbell set to `seqno`, both once the stream reaches
  // this point. `src` must hold still until the stream has passed it. Bounds are checked here:
  // InvalidArgument before anything is enqueued.
  virtual absl::Status EnqueueWrite(PeerId peer, uint32_t buffer, uint64_t offset, const void* src,
                                    size_t bytes, uint64_t seqno, void* stream) {
    (void)peer, (void)buffer, (void)offset, (void)src, (void)bytes, (void)seqno, (void)stream;
    return Unsupported("EnqueueWrite");
  }
  // Enqueues a wait until local buffer `buffer`'s doorbell reaches `seqno`, for the write of
  // `bytes` at `offset` that `peer` makes with that seqno (two-sided transports receive exactly
  // that; one-sided ones check the doorbell only). The stream's later work sees the bytes. The
  // wait gives up `timeout` after the stream reaches it; SyncStream then reports DeadlineExceeded
  // with `label` (who waits for what: "memory rank 1: attention output of step 7 layer 3"), the
  // seqno and the doorbell value seen, and every later wait falls through at once.
  virtual absl::Status EnqueueWait(PeerId peer, uint32_t buffer, uint64_t offset, size_t bytes,
                                   uint64_t seqno, absl::Duration timeout, const std::string& label,
                                   void* stream) {
    (void)peer, (void)buffer, (void)offset, (void)bytes, (void)seqno, (void)timeout, (void)label,
        (void)stream;
    return Unsupported("EnqueueWait");
  }
  // Whether device waits also check each payload against the checksum its writer stored beside
  // the doorbell (a mismatch: DataLoss from SyncStream naming the wait). On from the start where a
  // transport has such checksums (p2p); a rank sets it as its deployment says
  // (transport.checksums). The host-staged path's payloads carry their own (layer messages).
  virtual void SetDeviceChecksums(bool on) { (void)on; }

  // Waits until the work enqueued so far on `stream` has run, keeping the control plane moving.
  // Returns the first expired device wait (see EnqueueWait), Unavailable naming a peer that
  // failed (its pending waits are released rather than left to time out), a device error, or
  // DeadlineExceeded at `deadline`. After an error the device path stays failed until
  // ResetDevicePath: later calls return FailedPrecondition with the first error.
  virtual absl::Status SyncStream(void* stream, absl::Time deadline) {
    (void)stream, (void)deadline;
    return Unsupported("SyncStream");
  }

  // The caller's part of the host's waiting on the device path: `poll` is called while this
  // transport waits on the host for the device path (SyncStream; p2p's waits for a writer on the
  // same GPU), about every millisecond, outside any of this transport's own calls. An error from it
  // fails the step as a failed peer does: every pending wait is released and SyncStream returns
  // it. A memory rank takes compute rank 0's messages this way within a step (a heartbeat, a step
  // discard). Empty: none.
  virtual void SetDevicePoll(std::function<absl::Status()> poll) { (void)poll; }

  // After SyncStream failed (or the caller drained `stream` otherwise): the device path forgets
  // the failure, so that a step can run again (capabilities().device_path_reset). Nothing the
  // failed step enqueued may still run: FailedPrecondition when `stream` (or this transport's own
  // work for it) has not drained within a second. Doorbells keep their values: the rerun's seqnos
  // must start above every seqno the failed step used (a step discard's base).
  virtual absl::Status ResetDevicePath(void* stream) {
    (void)stream;
    return Unsupported("ResetDevicePath");
  }

 protected:
  absl::Status Unsupported(const char* what) const {
    return absl::UnimplementedError(std::string("the ") + capabilities().name +
                                    " transport has no device data path (" + what + ")");
  }
};

struct UcxOptions {
  // "host:port" to listen on (port 0: any free port; the chosen one is in address()); empty: do
  // not listen (a process that only connects).
  std::string listen_address;
  // How long Send and Write wait for local completion (a large message needs the peer to fetch
  // it, so a stopped peer would hold it forever). Past it the send is cancelled and the peer is
  // marked failed: Unavailable naming it, from then on. Infinite: wait as long as it takes.
  absl::Duration send_timeout = absl::InfiniteDuration();
};

// UCX (the Debian package; tcp, shared memory and whatever else UCX finds): host memory only.
// Unavailable with UCX's reason if the context, worker or listener cannot be created.
absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const UcxOptions& options);

}  // namespace tandem::transport
