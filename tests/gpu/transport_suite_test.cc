// One suite over every transport kind (ucx, p2p, nccl, verbs), each between two processes: this
// test (listening, cuda:0) and a child process (this binary in helper mode; cuda:1 when there are
// two GPUs, else cuda:0 as well). Per kind, in one session:
//   1. host path: the child writes payloads that record their origin (its pid) and message number,
//      16 B to 64 MiB, five times each, with Write + seqno; the parent waits for each doorbell,
//      hashes the bytes it reads back (FNV-1a 64) against the expected payload's, checks that no
//      byte past the message changed, poisons the buffer and acks, so every repeat must rewrite it;
//   2. device path (transports with device_polling): the same with EnqueueWrite + SyncStream on the
//      child's stream and EnqueueWait + SyncStream on the parent's;
//   3. errors: out-of-bounds writes are refused by the writer (InvalidArgument, nothing sent) or,
//      on a transport whose writer does not know the remote size (ucx), dropped by the receiver
//      and reported as DataLoss, with nothing placed either way; unknown buffers are NotFound; a
//      transport without a device path answers Unimplemented;
//   4. a device wait that never gets its write expires (200 ms): SyncStream reports
//      DeadlineExceeded with the wait's label and seqno within seconds, then FailedPrecondition.
// A kind skips with the reason when it is not built, when there is no GPU, when it needs two GPUs
// and there is one (nccl), or when it finds no hardware (Unavailable; verbs without an RDMA NIC).
// The child prints its one-way write times per size (best of 5, informative only).
#include <cuda_runtime.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/transport/factory.h"
#include "gpu_test_util.h"
#include "gtest/gtest.h"
#include "transport_test_util.h"

namespace tandem::transport {
namespace {

using testing_transport::Fnv1a;
using testing_transport::Payload;
using testing_transport::Text;

constexpr char kAddressEnv[] = "TANDEM_TRANSPORT_SUITE_CONNECT_TO";
constexpr char kKindEnv[] = "TANDEM_TRANSPORT_SUITE_KIND";
constexpr uint32_t kDataBuffer = 1;   // the parent's: every size of both paths
constexpr uint32_t kErrorBuffer = 3;  // the parent's: the error cases
constexpr uint32_t kUnknownBuffer = 99;
constexpr size_t kDataBytes = (64u << 20) + 64;  // the largest message and a guard after it
constexpr size_t kErrorBytes = 64u << 10;
constexpr size_t kErrorMessage = 4096;
constexpr int kRepeats = 5;
constexpr uint8_t kPoison = 0xEE;
const size_t kSizes[] = {16, 4096, 64u << 10, 1u << 20, 16u << 20, 64u << 20};
constexpr size_t kNumSizes = sizeof(kSizes) / sizeof(kSizes[0]);
// Seqnos of the data buffer: the host path's messages, then the device path's, then the wait that
// never gets its write.
constexpr uint64_t kDeviceFirstSeq = kNumSizes * kRepeats + 1;
constexpr uint64_t kNeverWrittenSeq = 2 * kNumSizes * kRepeats + 1;
// Payload keys of the error messages (their seqnos on the error buffer are 1 and 3).
constexpr uint64_t kErrorKeyFirst = 1001, kErrorKeyLast = 1003;

absl::Time In(absl::Duration d) { return absl::Now() + d; }

std::string CudaError(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

// Memory of the current CUDA device or of the host: a transport's buffers and sources live in the
// first when it has gpu_memory, else in the second.
class Memory {
 public:
  Memory(bool device, size_t bytes) : device_(device), bytes_(bytes) {
    if (device_) {
      error_ = cudaMalloc(&p_, bytes);
      if (error_ != cudaSuccess) p_ = nullptr;
    } else {
      p_ = std::malloc(bytes);
    }
  }
  ~Memory() {
    if (device_) {
      cudaFree(p_);
    } else {
      std::free(p_);
    }
  }
  Memory(const Memory&) = delete;
  Memory& operator=(const Memory&) = delete;

  uint8_t* data() const { return static_cast<uint8_t*>(p_); }
  // Empty when allocated, else why not.
  std::string Failure() const {
    if (p_ != nullptr) return "";
    return absl::StrCat("allocating ", bytes_, " bytes of ", device_ ? "device" : "host",
                        " memory: ", device_ ? CudaError(error_) : "out of memory");
  }
  cudaError_t Upload(const std::vector<uint8_t>& bytes, size_t offset = 0) {
    if (!device_) {
      std::memcpy(data() + offset, bytes.data(), bytes.size());
      return cudaSuccess;
    }
    const cudaError_t e = cudaMemcpy(data() + offset, bytes.data(), bytes.size(), cudaMemcpyHostToDevice);
    return e != cudaSuccess ? e : cudaDeviceSynchronize();
  }
  cudaError_t Read(size_t offset, size_t bytes, std::vector<uint8_t>* out) const {
    out->resize(bytes);
    if (!device_) {
      std::memcpy(out->data(), data() + offset, bytes);
      return cudaSuccess;
    }
    return cudaMemcpy(out->data(), data() + offset, bytes, cudaMemcpyDeviceToHost);
  }
  // Fills [0, bytes) with `value`, complete on return (before an ack lets the next write come).
  cudaError_t Fill(uint8_t value, size_t bytes) {
    if (!device_) {
      std::memset(p_, value, bytes);
      return cudaSuccess;
    }
    const cudaError_t e = cudaMemset(p_, value, bytes);
    return e != cudaSuccess ? e : cudaDeviceSynchronize();
  }

 private:
  bool device_;
  size_t bytes_;
  void* p_ = nullptr;
  cudaError_t error_ = cudaSuccess;
};

struct Stream {
  cudaStream_t s = nullptr;
  cudaError_t error = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  ~Stream() {
    if (s != nullptr) cudaStreamDestroy(s);
  }
  void* get() const { return s; }
};

// The next control message, which must be `want`.
void ExpectMessage(Transport& t, const std::string& want) {
  PeerId from;
  std::vector<uint8_t> m;
  const absl::Status s = t.Receive(&from, &m, In(absl::Seconds(120)));
  ASSERT_TRUE(s.ok()) << "waiting for \"" << want << "\": " << s;
  ASSERT_EQ(std::string(m.begin(), m.end()), want);
}

#define SUITE_CUDA_ASSERT(expr)                                                   \
  do {                                                                            \
    const cudaError_t suite_err_ = (expr);                                        \
    ASSERT_EQ(suite_err_, cudaSuccess) << #expr << ": " << CudaError(suite_err_); \
  } while (0)

// ---- The child: writes everything the parent checks --------------------------------------------

void ChildSession(Transport& t, PeerId peer, int device) {
  const Capabilities& caps = t.capabilities();
  const uint64_t origin = static_cast<uint64_t>(getpid());
  double host_us[kNumSizes] = {}, device_us[kNumSizes] = {};
  // 1. Host path: Write from device memory when the transport takes it, else from host memory.
  uint64_t seq = 0;
  for (size_t s = 0; s < kNumSizes; ++s) {
    const size_t bytes = kSizes[s];
    Memory src(caps.gpu_memory, bytes);
    ASSERT_EQ(src.Failure(), "");
    SUITE_CUDA_ASSERT(src.Upload(Payload(origin, seq + 1, bytes)));  // keyed by the size's first seqno
    host_us[s] = 1e30;
    for (int rep = 0; rep < kRepeats; ++rep) {
      ++seq;
      const absl::Span<const uint8_t> piece(src.data(), bytes);
      const auto t0 = std::chrono::steady_clock::now();
      const absl::Status st = t.Write(peer, kDataBuffer, 0, {&piece, 1}, seq);
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      ASSERT_TRUE(st.ok()) << "host write of " << bytes << " bytes, message " << seq << ": " << st;
      host_us[s] = std::min(host_us[s], us);
      ASSERT_NO_FATAL_FAILURE(ExpectMessage(t, absl::StrCat("ack ", seq)));
    }
  }
  // 2. Device path: EnqueueWrite from device memory on this process's stream, then SyncStream.
  if (caps.device_polling) {
    Stream stream;
    SUITE_CUDA_ASSERT(stream.error);
    for (size_t s = 0; s < kNumSizes; ++s) {
      const size_t bytes = kSizes[s];
      Memory src(true, bytes);
      ASSERT_EQ(src.Failure(), "");
      SUITE_CUDA_ASSERT(src.Upload(Payload(origin, seq + 1, bytes)));
      device_us[s] = 1e30;
      for (int rep = 0; rep < kRepeats; ++rep) {
        ++seq;
        const auto t0 = std::chrono::steady_clock::now();
        absl::Status st = t.EnqueueWrite(peer, kDataBuffer, 0, src.data(), bytes, seq, stream.get());
        if (st.ok()) st = t.SyncStream(stream.get(), In(absl::Seconds(60)));
        const double us =
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        ASSERT_TRUE(st.ok()) << "device write of " << bytes << " bytes, message " << seq << ": " << st;
        device_us[s] = std::min(device_us[s], us);
        ASSERT_NO_FATAL_FAILURE(ExpectMessage(t, absl::StrCat("ack ", seq)));
      }
    }
  }
  // 3. Errors. A valid write first, so that the writer knows the buffer's size.
  {
    Memory src(caps.gpu_memory, kErrorMessage);
    ASSERT_EQ(src.Failure(), "");
    SUITE_CUDA_ASSERT(src.Upload(Payload(origin, kErrorKeyFirst, kErrorMessage)));
    const absl::Span<const uint8_t> piece(src.data(), kErrorMessage);
    const absl::Status st = t.Write(peer, kErrorBuffer, 0, {&piece, 1}, 1);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_NO_FATAL_FAILURE(ExpectMessage(t, "ack e1"));
  }
  {
    // Past the end (an in-bounds head and an out-of-bounds tail), and an offset whose end wraps.
    Memory src(caps.gpu_memory, 128);
    ASSERT_EQ(src.Failure(), "");
    SUITE_CUDA_ASSERT(src.Upload(Payload(origin, 1002, 128)));
    const absl::Span<const uint8_t> tail(src.data(), 128), wrap(src.data(), 16);
    const uint64_t wrap_offset = std::numeric_limits<uint64_t>::max() - 8;
    const absl::Status past = t.Write(peer, kErrorBuffer, kErrorBytes - 64, {&tail, 1}, 2);
    const absl::Status wraps = t.Write(peer, kErrorBuffer, wrap_offset, {&wrap, 1}, 2);
    if (caps.device_polling) {
      // These transports know the remote buffer's size (EnqueueWrite checks bounds), so Write must too.
      EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument) << past;
      EXPECT_EQ(wraps.code(), absl::StatusCode::kInvalidArgument) << wraps;
      Memory dsrc(true, 128);
      ASSERT_EQ(dsrc.Failure(), "");
      Stream stream;
      SUITE_CUDA_ASSERT(stream.error);
      const absl::Status e1 =
          t.EnqueueWrite(peer, kErrorBuffer, kErrorBytes - 64, dsrc.data(), 128, 2, stream.get());
      const absl::Status e2 =
          t.EnqueueWrite(peer, kErrorBuffer, wrap_offset, dsrc.data(), 16, 2, stream.get());
      EXPECT_EQ(e1.code(), absl::StatusCode::kInvalidArgument) << e1;
      EXPECT_EQ(e2.code(), absl::StatusCode::kInvalidArgument) << e2;
      const absl::Status sync = t.SyncStream(stream.get(), In(absl::Seconds(10)));
      EXPECT_TRUE(sync.ok()) << "refused writes must leave the device path usable: " << sync;
    } else {
      for (const absl::Status* st : {&past, &wraps}) {
        EXPECT_TRUE(st->ok() || absl::IsInvalidArgument(*st)) << *st;
      }
      Stream stream;
      SUITE_CUDA_ASSERT(stream.error);
      EXPECT_EQ(t.EnqueueWrite(peer, kErrorBuffer, 0, src.data(), 16, 2, stream.get()).code(),
                absl::StatusCode::kUnimplemented);
      EXPECT_EQ(
          t.EnqueueWait(peer, kErrorBuffer, 0, 16, 2, absl::Seconds(1), "suite: child", stream.get()).code(),
          absl::StatusCode::kUnimplemented);
      EXPECT_EQ(t.SyncStream(stream.get(), In(absl::Seconds(1))).code(), absl::StatusCode::kUnimplemented);
    }
    // The parent learns which writes were refused here (and must not have arrived) and which
    // went out (and must have been dropped there).
    ASSERT_TRUE(t.Send(peer, Text(absl::StrCat("refused ", static_cast<int>(past.code()), " ",
                                               static_cast<int>(wraps.code()), " ", wrap_offset)))
                    .ok());
  }
  ASSERT_NO_FATAL_FAILURE(ExpectMessage(t, "go"));
  {
    Memory src(caps.gpu_memory, kErrorMessage);
    ASSERT_EQ(src.Failure(), "");
    SUITE_CUDA_ASSERT(src.Upload(Payload(origin, kErrorKeyLast, kErrorMessage)));
    const absl::Span<const uint8_t> piece(src.data(), kErrorMessage);
    const absl::Status st = t.Write(peer, kErrorBuffer, 64, {&piece, 1}, 3);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_NO_FATAL_FAILURE(ExpectMessage(t, "ack e3"));
  }
  for (size_t s = 0; s < kNumSizes; ++s) {
    const std::string dev = caps.device_polling ? absl::StrFormat("%.1f us", device_us[s]) : "n/a";
    std::printf(
        "%s write cuda:%d -> cuda:0, %zu bytes: host-driven %.1f us, device-driven %s (one-way, as the "
        "writer sees it, best of %d)\n",
        caps.name.c_str(), device, kSizes[s], host_us[s], dev.c_str(), kRepeats);
  }
  std::fflush(stdout);
  ASSERT_NO_FATAL_FAILURE(ExpectMessage(t, "bye"));
  t.Close(peer);
}

TEST(TransportSuiteChild, DISABLED_Run) {
  const char* address = std::getenv(kAddressEnv);
  const char* kind_name = std::getenv(kKindEnv);
  if (address == nullptr || kind_name == nullptr) GTEST_SKIP() << "helper for TransportSuite; run by it";
  const absl::StatusOr<TransportKind> kind = ParseTransportKind(kind_name);
  ASSERT_TRUE(kind.ok()) << kind.status();
  const int device = testing_gpu::GpuCount() >= 2 ? 1 : 0;
  SUITE_CUDA_ASSERT(cudaSetDevice(device));
  auto t = CreateTransport({.kind = *kind, .listen_address = "", .device = device});
  ASSERT_TRUE(t.ok()) << t.status();
  auto peer = (*t)->Connect(address);
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_TRUE((*t)->Send(*peer, Text(absl::StrCat("hello from cuda:", device))).ok());
  ChildSession(**t, *peer, device);
}

// ---- The parent: checks every message ---------------------------------------------------------

pid_t SpawnChild(const std::string& kind, const std::string& address) {
  return testing_transport::SpawnSelf(
      "TransportSuiteChild.DISABLED_Run",
      {absl::StrCat(kAddressEnv, "=", address), absl::StrCat(kKindEnv, "=", kind)});
}

class TransportSuite : public ::testing::TestWithParam<std::string> {
 protected:
  void TearDown() override {
    if (child_ > 0) {  // a failure left it waiting: end it
      kill(child_, SIGKILL);
      waitpid(child_, nullptr, 0);
      child_ = -1;
    }
  }

  // Waits up to `timeout` for the child; its exit status, or -1 (it is killed) on timeout.
  int ReapChild(absl::Duration timeout) {
    const absl::Time until = In(timeout);
    int status = 0;
    while (absl::Now() < until) {
      const pid_t r = waitpid(child_, &status, WNOHANG);
      if (r == child_) {
        child_ = -1;
        return status;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }

  // Hash of [offset, offset + bytes) of `m`.
  uint64_t HashOf(const Memory& m, size_t offset, size_t bytes) {
    std::vector<uint8_t> v;
    const cudaError_t e = m.Read(offset, bytes, &v);
    EXPECT_EQ(e, cudaSuccess) << CudaError(e);
    return Fnv1a(v);
  }

  // Checks message `seq` (`bytes` bytes of `want_hash`) in the data buffer, and that the guard after
  // it is untouched; then poisons it and acks.
  void CheckAndAck(uint64_t seq, size_t bytes, uint64_t want_hash, uint64_t* got_hash) {
    *got_hash = HashOf(*data_, 0, bytes);
    ASSERT_EQ(*got_hash, want_hash) << bytes << " bytes, message " << seq << ": the bytes read back differ";
    std::vector<uint8_t> guard;
    SUITE_CUDA_ASSERT(data_->Read(bytes, 64, &guard));
    ASSERT_TRUE(std::all_of(guard.begin(), guard.end(), [](uint8_t b) { return b == kPoison; }))
        << "message " << seq << " wrote past its " << bytes << " bytes";
    SUITE_CUDA_ASSERT(data_->Fill(kPoison, bytes));  // the next message must rewrite it
    ASSERT_TRUE(t_->Send(peer_, Text(absl::StrCat("ack ", seq))).ok());
  }

  void HostPath() {
    uint64_t seq = 0;
    for (size_t bytes : kSizes) {
      const uint64_t want = Fnv1a(Payload(child_origin_, seq + 1, bytes));
      uint64_t hashes[kRepeats];
      for (int rep = 0; rep < kRepeats; ++rep) {
        ++seq;
        const absl::Status s = t_->WaitDoorbell(kDataBuffer, seq, In(absl::Seconds(120)));
        ASSERT_TRUE(s.ok()) << "host path, " << bytes << " bytes, message " << seq << ": " << s;
        EXPECT_EQ(t_->Doorbell(kDataBuffer), seq);
        ASSERT_NO_FATAL_FAILURE(CheckAndAck(seq, bytes, want, &hashes[rep]));
      }
      for (int rep = 1; rep < kRepeats; ++rep)
        EXPECT_EQ(hashes[rep], hashes[0]) << bytes << " bytes, repeat " << rep;
    }
  }

  void DevicePath() {
    Stream stream;
    SUITE_CUDA_ASSERT(stream.error);
    uint64_t seq = kDeviceFirstSeq - 1;
    for (size_t bytes : kSizes) {
      const uint64_t want = Fnv1a(Payload(child_origin_, seq + 1, bytes));
      uint64_t hashes[kRepeats];
      for (int rep = 0; rep < kRepeats; ++rep) {
        ++seq;
        const std::string label = absl::StrCat("suite: message ", seq);
        absl::Status s =
            t_->EnqueueWait(peer_, kDataBuffer, 0, bytes, seq, absl::Seconds(60), label, stream.get());
        if (s.ok()) s = t_->SyncStream(stream.get(), In(absl::Seconds(120)));
        ASSERT_TRUE(s.ok()) << "device path, " << bytes << " bytes, message " << seq << ": " << s;
        ASSERT_NO_FATAL_FAILURE(CheckAndAck(seq, bytes, want, &hashes[rep]));
      }
      for (int rep = 1; rep < kRepeats; ++rep)
        EXPECT_EQ(hashes[rep], hashes[0]) << bytes << " bytes, repeat " << rep;
    }
  }

  void Errors() {
    const Capabilities& caps = t_->capabilities();
    // The valid first write.
    absl::Status s = t_->WaitDoorbell(kErrorBuffer, 1, In(absl::Seconds(120)));
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(HashOf(*errors_, 0, kErrorMessage),
              Fnv1a(Payload(child_origin_, kErrorKeyFirst, kErrorMessage)));
    SUITE_CUDA_ASSERT(errors_->Fill(kPoison, kErrorBytes));
    ASSERT_TRUE(t_->Send(peer_, Text("ack e1")).ok());
    // The out-of-bounds writes: the child's verdicts, and DataLoss here for any that went out.
    std::vector<absl::Status> dropped;
    PeerId from;
    std::vector<uint8_t> m;
    while (true) {
      s = t_->Receive(&from, &m, In(absl::Seconds(120)));
      if (absl::IsDataLoss(s)) {
        dropped.push_back(s);
        continue;
      }
      ASSERT_TRUE(s.ok()) << s;
      break;
    }
    // Any report still pending comes with the next wait.
    while (absl::IsDataLoss(s = t_->WaitDoorbell(kErrorBuffer, 1, In(absl::Milliseconds(200)))))
      dropped.push_back(s);
    EXPECT_TRUE(s.ok()) << s;
    const std::vector<std::string> words = absl::StrSplit(std::string(m.begin(), m.end()), ' ');
    int past = -1, wraps = -1;
    ASSERT_EQ(words.size(), 4u) << std::string(m.begin(), m.end());
    ASSERT_EQ(words[0], "refused");
    ASSERT_TRUE(absl::SimpleAtoi(words[1], &past) && absl::SimpleAtoi(words[2], &wraps));
    const auto kInvalid = static_cast<int>(absl::StatusCode::kInvalidArgument);
    if (caps.device_polling) {
      EXPECT_EQ(past, kInvalid) << "a write past the buffer's end must be refused by the writer";
      EXPECT_EQ(wraps, kInvalid) << "a write whose end wraps must be refused by the writer";
    }
    const std::string past_offset = absl::StrCat(kErrorBytes - 64);
    std::vector<std::string> sent;  // offsets of the writes that went out
    if (past == 0) sent.push_back(past_offset);
    if (wraps == 0) sent.push_back(words[3]);
    ASSERT_EQ(dropped.size(), sent.size()) << "every out-of-bounds write that went out must be reported here";
    for (size_t i = 0; i < sent.size(); ++i) {
      EXPECT_NE(std::string(dropped[i].message()).find(sent[i]), std::string::npos)
          << "the report names the offset: " << dropped[i];
    }
    std::printf("%s: out-of-bounds writes %s\n", caps.name.c_str(),
                sent.empty() ? "refused by the writer (InvalidArgument)"
                             : "sent, then dropped by the receiver (DataLoss)");
    EXPECT_EQ(t_->Doorbell(kErrorBuffer), 1u);
    std::vector<uint8_t> all;
    SUITE_CUDA_ASSERT(errors_->Read(0, kErrorBytes, &all));
    EXPECT_TRUE(std::all_of(all.begin(), all.end(), [](uint8_t b) { return b == kPoison; }))
        << "a refused write placed bytes";
    // The stream still works: the next valid write lands whole.
    ASSERT_TRUE(t_->Send(peer_, Text("go")).ok());
    s = t_->WaitDoorbell(kErrorBuffer, 3, In(absl::Seconds(120)));
    ASSERT_TRUE(s.ok()) << s;
    std::vector<uint8_t> head;
    SUITE_CUDA_ASSERT(errors_->Read(0, 64, &head));
    EXPECT_TRUE(std::all_of(head.begin(), head.end(), [](uint8_t b) { return b == kPoison; }));
    EXPECT_EQ(HashOf(*errors_, 64, kErrorMessage),
              Fnv1a(Payload(child_origin_, kErrorKeyLast, kErrorMessage)));
    ASSERT_TRUE(t_->Send(peer_, Text("ack e3")).ok());
    // Unknown buffers, and the device path's calls where there is none.
    EXPECT_EQ(t_->WaitDoorbell(kUnknownBuffer, 1, In(absl::Milliseconds(10))).code(),
              absl::StatusCode::kNotFound);
    Stream stream;
    SUITE_CUDA_ASSERT(stream.error);
    const absl::Status wait = t_->EnqueueWait(peer_, kUnknownBuffer, 0, 16, 1, absl::Seconds(1),
                                              "suite: unknown buffer", stream.get());
    if (caps.device_polling) {
      EXPECT_EQ(wait.code(), absl::StatusCode::kNotFound) << wait;
      s = t_->SyncStream(stream.get(), In(absl::Seconds(10)));
      EXPECT_TRUE(s.ok()) << "a refused wait must leave the device path usable: " << s;
    } else {
      EXPECT_EQ(wait.code(), absl::StatusCode::kUnimplemented) << wait;
      EXPECT_EQ(t_->EnqueueWrite(peer_, kDataBuffer, 0, data_->data(), 16, 1, stream.get()).code(),
                absl::StatusCode::kUnimplemented);
      EXPECT_EQ(t_->SyncStream(stream.get(), In(absl::Seconds(1))).code(), absl::StatusCode::kUnimplemented);
    }
  }

  // Last: the device path stays failed afterwards.
  void DeviceTimeout() {
    Stream stream;
    SUITE_CUDA_ASSERT(stream.error);
    const std::string label = "suite: message that is never written";
    const absl::Time start = absl::Now();
    absl::Status s = t_->EnqueueWait(peer_, kDataBuffer, 0, 16, kNeverWrittenSeq, absl::Milliseconds(200),
                                     label, stream.get());
    ASSERT_TRUE(s.ok()) << s;
    s = t_->SyncStream(stream.get(), In(absl::Seconds(30)));
    const absl::Duration took = absl::Now() - start;
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    std::string message(s.message());
    const size_t at = message.find(label);
    EXPECT_NE(at, std::string::npos) << "the label: " << s;
    if (at != std::string::npos) message.erase(at, label.size());
    EXPECT_NE(message.find(absl::StrCat(kNeverWrittenSeq)), std::string::npos) << "the seqno: " << s;
    EXPECT_LT(took, absl::Seconds(5)) << s;
    const absl::Status after = t_->SyncStream(stream.get(), In(absl::Seconds(5)));
    EXPECT_EQ(after.code(), absl::StatusCode::kFailedPrecondition) << after;
  }

  // Declared before the transport, which must go first.
  std::unique_ptr<Memory> data_, errors_;
  std::unique_ptr<Transport> t_;
  PeerId peer_ = 0;
  pid_t child_ = -1;
  uint64_t child_origin_ = 0;
};

TEST_P(TransportSuite, TwoProcesses) {
  const std::string name = GetParam();
  const absl::StatusOr<TransportKind> kind = ParseTransportKind(name);
  ASSERT_TRUE(kind.ok()) << kind.status();
  if (!TransportBuilt(*kind)) {
    GTEST_SKIP() << CreateTransport({.kind = *kind}).status().message();
  }
  const std::string no_gpu = testing_gpu::NoGpuReason();
  if (!no_gpu.empty()) GTEST_SKIP() << no_gpu;
  const int gpus = testing_gpu::GpuCount();
  if (*kind == TransportKind::kNccl && gpus < 2) {
    GTEST_SKIP() << "nccl needs two GPUs (NCCL refuses two ranks on one GPU); this machine has " << gpus;
  }
  SUITE_CUDA_ASSERT(cudaSetDevice(0));
  auto created = CreateTransport({.kind = *kind, .listen_address = "127.0.0.1:0", .device = 0});
  if (absl::IsUnavailable(created.status())) {
    std::printf("%s: %s\n", name.c_str(), std::string(created.status().message()).c_str());
    GTEST_SKIP() << name << " is unavailable here: " << created.status().message();
  }
  ASSERT_TRUE(created.ok()) << created.status();
  const Capabilities caps = (*created)->capabilities();
  EXPECT_EQ(caps.name, name);
  data_ = std::make_unique<Memory>(caps.gpu_memory, kDataBytes);
  errors_ = std::make_unique<Memory>(caps.gpu_memory, kErrorBytes);
  ASSERT_EQ(data_->Failure(), "");
  ASSERT_EQ(errors_->Failure(), "");
  SUITE_CUDA_ASSERT(data_->Fill(kPoison, kDataBytes));
  SUITE_CUDA_ASSERT(errors_->Fill(kPoison, kErrorBytes));
  t_ = std::move(*created);
  ASSERT_TRUE(t_->RegisterBuffer(kDataBuffer, data_->data(), kDataBytes).ok());
  ASSERT_TRUE(t_->RegisterBuffer(kErrorBuffer, errors_->data(), kErrorBytes).ok());

  child_ = SpawnChild(name, t_->address());
  ASSERT_GT(child_, 0);
  child_origin_ = static_cast<uint64_t>(child_);
  auto peer = t_->Accept(In(absl::Seconds(120)));
  ASSERT_TRUE(peer.ok()) << peer.status();
  peer_ = *peer;
  PeerId from;
  std::vector<uint8_t> hello;
  const absl::Status s = t_->Receive(&from, &hello, In(absl::Seconds(120)));
  ASSERT_TRUE(s.ok()) << s;
  std::printf("%s (gpu_memory %d, device_polling %d): child says %s; %d GPU(s) here\n", name.c_str(),
              caps.gpu_memory, caps.device_polling, std::string(hello.begin(), hello.end()).c_str(), gpus);

  {
    SCOPED_TRACE("host path");
    ASSERT_NO_FATAL_FAILURE(HostPath());
  }
  if (caps.device_polling) {
    SCOPED_TRACE("device path");
    ASSERT_NO_FATAL_FAILURE(DevicePath());
  } else {
    std::printf("%s: no device path (device_polling is false)\n", name.c_str());
  }
  {
    SCOPED_TRACE("errors");
    ASSERT_NO_FATAL_FAILURE(Errors());
  }
  if (caps.device_polling) {
    SCOPED_TRACE("device wait timeout");
    ASSERT_NO_FATAL_FAILURE(DeviceTimeout());
  }
  t_->Close(peer_);
  ASSERT_TRUE(t_->Send(peer_, Text("bye")).ok());
  const int status = ReapChild(absl::Seconds(60));
  EXPECT_TRUE(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the child failed (its output is above); status " << status;
}

INSTANTIATE_TEST_SUITE_P(EveryKind, TransportSuite, ::testing::Values("ucx", "p2p", "nccl", "verbs"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace tandem::transport
