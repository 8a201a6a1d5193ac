// Transport latency and bandwidth: the one-way time of a layer message vs its size, between two
// processes (this one on cuda:0, a child process of this binary on cuda:1, or on cuda:0 as well
// when there is one GPU), by ping-pong: the parent writes into the child's buffer, the child waits
// for it and writes the same size back; one-way = round trip / 2. Not a test: prints a table per
// transport (and JSON with --json).
//
//   transport_bench [--kinds p2p,nccl,ucx] [--sizes 16,4096,...] [--iters N] [--warmup N] [--json PATH]
//
// Two modes per size:
//   host-driven    every message is a Write from the host, received by WaitDoorbell on the host;
//                  timed on the host clock;
//   device-polled  (transports with device_polling) both sides enqueue the whole chain at once on
//                  one stream each (parent: write -> wait for the reply; child: wait -> write back)
//                  and then call SyncStream once; timed by CUDA events on the parent's stream from
//                  the end of the warm-up round trips to the end of the chain.
// Payloads are fresh random bytes (never zero; receive buffers are zeroed before each run), one
// for every message but the last and another for the last, so the receivers' checks of the first
// and of the last message (FNV-1a 64 of the bytes read back) see stale data; a mismatch fails the
// run. GB/s = size / the best mode's one-way time, against the peer copy of the same size measured
// here (cudaMemcpyPeerAsync cuda:0 -> cuda:1, or a device-to-device copy on one GPU; median).
// Rows: kind size host_us device_us GB/s peer_GB/s %peer. Progress goes to stderr.
#include <cuda_runtime.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench_cuda.h"
#include "common/bootstrap/deployment_key.h"
#include "common/status.h"
#include "common/transport/factory.h"

namespace {

using ::tandem::transport::Capabilities;
using ::tandem::transport::CreateTransport;
using ::tandem::transport::ParseTransportKind;
using ::tandem::transport::PeerId;
using ::tandem::transport::Transport;
using ::tandem::transport::TransportBuilt;
using ::tandem::transport::TransportKind;

constexpr uint32_t kParentBuffer = 1;  // the parent's receive buffer (the child writes into it)
constexpr uint32_t kChildBuffer = 2;   // the child's
constexpr int kHostMode = 0, kDeviceMode = 1;
const char* const kModeNames[] = {"host-driven", "device-polled"};

struct Options {
  std::vector<std::string> kinds = {"p2p", "nccl", "ucx"};
  std::vector<size_t> sizes = {16, 4096, 65536, 1u << 20, 16u << 20, 64u << 20};
  int iters = 100;
  int warmup = 10;
  std::string json;
  // Child mode (run by the parent): --child KIND ADDRESS SEED.
  bool child = false;
  std::string child_kind, connect;
  uint64_t seed = 0;
};

[[noreturn]] void Usage(const char* argv0, int code) {
  std::fprintf(code == 0 ? stdout : stderr,
               "usage: %s [--kinds p2p,nccl,ucx] [--sizes 16,4096,65536,1048576,16777216,67108864]\n"
               "          [--iters N] [--warmup N] [--json PATH]\n"
               "  --kinds   transports to measure (ucx, p2p, nccl, verbs); one that is not built or finds\n"
               "            no hardware is skipped with the reason\n"
               "  --sizes   message sizes in bytes\n"
               "  --iters   timed round trips per size and mode (default 100)\n"
               "  --warmup  untimed round trips before them (default 10, at least 1)\n"
               "  --json    also write the results there\n",
               argv0);
  std::exit(code);
}

Options ParseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Usage(argv[0], 2);
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      Usage(argv[0], 0);
    } else if (a == "--kinds") {
      o.kinds = absl::StrSplit(value(), ',', absl::SkipEmpty());
    } else if (a == "--sizes") {
      o.sizes.clear();
      for (absl::string_view s : absl::StrSplit(value(), ',', absl::SkipEmpty())) {
        uint64_t n = 0;
        if (!absl::SimpleAtoi(s, &n) || n == 0) Usage(argv[0], 2);
        o.sizes.push_back(n);
      }
    } else if (a == "--iters") {
      o.iters = std::max(1, std::atoi(value().c_str()));
    } else if (a == "--warmup") {
      o.warmup = std::max(1, std::atoi(value().c_str()));
    } else if (a == "--json") {
      o.json = value();
    } else if (a == "--child" && i + 3 < argc) {
      o.child = true;
      o.child_kind = argv[++i];
      o.connect = argv[++i];
      if (!absl::SimpleAtoi(argv[++i], &o.seed)) Usage(argv[0], 2);
    } else {
      Usage(argv[0], 2);
    }
  }
  if (o.sizes.empty() || o.kinds.empty()) Usage(argv[0], 2);
  return o;
}

absl::Time In(absl::Duration d) { return absl::Now() + d; }

std::string SizeName(size_t bytes) {
  if (bytes >= (1u << 20) && bytes % (1u << 20) == 0) return absl::StrCat(bytes >> 20, " MiB");
  if (bytes >= 1024 && bytes % 1024 == 0) return absl::StrCat(bytes >> 10, " KiB");
  return absl::StrCat(bytes, " B");
}

uint64_t Fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

// Random bytes, none zero, determined by (seed, sender, size, mode, variant): variant 0 is every
// message of a run but the last, variant 1 the last.
std::vector<uint8_t> Payload(uint64_t seed, int sender, size_t bytes, int mode, int variant) {
  std::vector<uint8_t> v(bytes);
  uint64_t state = seed ^ (static_cast<uint64_t>(sender) << 62) ^ (static_cast<uint64_t>(mode) << 60) ^
                   (static_cast<uint64_t>(variant) << 59) ^ (bytes * 0xD6E8FEB86659FD93ull);
  for (size_t i = 0; i < bytes; i += 8) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);  // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    for (size_t b = 0; b < 8 && i + b < bytes; ++b) {
      const uint8_t byte = static_cast<uint8_t>(z >> (8 * b));
      v[i + b] = byte != 0 ? byte : 0x5A;
    }
  }
  return v;
}

uint64_t PayloadHash(uint64_t seed, int sender, size_t bytes, int mode, int variant) {
  const std::vector<uint8_t> v = Payload(seed, sender, bytes, mode, variant);
  return Fnv1a(v.data(), v.size());
}

// Device memory of the current GPU, or host memory.
class Memory {
 public:
  Memory(bool device, size_t bytes) : device_(device) {
    if (device_) {
      BENCH_CUDA(cudaMalloc(&p_, bytes));
    } else {
      p_ = std::malloc(bytes);
      if (p_ == nullptr) {
        std::fprintf(stderr, "out of host memory (%zu bytes)\n", bytes);
        std::exit(1);
      }
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
  void Upload(const std::vector<uint8_t>& v) {
    if (device_) {
      BENCH_CUDA(cudaMemcpy(p_, v.data(), v.size(), cudaMemcpyHostToDevice));
      BENCH_CUDA(cudaDeviceSynchronize());
    } else {
      std::memcpy(p_, v.data(), v.size());
    }
  }
  void Zero(size_t bytes) {
    if (device_) {
      BENCH_CUDA(cudaMemset(p_, 0, bytes));
      BENCH_CUDA(cudaDeviceSynchronize());
    } else {
      std::memset(p_, 0, bytes);
    }
  }
  uint64_t Hash(size_t bytes) const {
    if (!device_) return Fnv1a(data(), bytes);
    std::vector<uint8_t> v(bytes);
    BENCH_CUDA(cudaMemcpy(v.data(), p_, bytes, cudaMemcpyDeviceToHost));
    return Fnv1a(v.data(), bytes);
  }

 private:
  bool device_;
  void* p_ = nullptr;
};

absl::Status CheckHash(const Memory& m, size_t bytes, uint64_t want, const std::string& what) {
  const uint64_t got = m.Hash(bytes);
  if (got == want) return absl::OkStatus();
  return absl::DataLossError(absl::StrFormat("payload mismatch: %s (%zu bytes): hash %016x, expected %016x",
                                             what, bytes, got, want));
}

std::vector<uint8_t> Text(const std::string& s) { return {s.begin(), s.end()}; }

// The next control message; a child's "bad ..." becomes an error.
absl::StatusOr<std::string> NextMessage(Transport& t) {
  PeerId from;
  std::vector<uint8_t> m;
  RETURN_IF_ERROR(t.Receive(&from, &m, In(absl::Seconds(300))));
  std::string s(m.begin(), m.end());
  if (absl::StartsWith(s, "bad ")) return absl::InternalError(absl::StrCat("child: ", s.substr(4)));
  return s;
}

absl::Status Expect(Transport& t, const std::string& want) {
  ASSIGN_OR_RETURN(const std::string got, NextMessage(t));
  if (got != want) return absl::InternalError(absl::StrCat("expected \"", want, "\", got \"", got, "\""));
  return absl::OkStatus();
}

// One side of one ping-pong run (size, mode): the sources of both variants, the receive buffer and,
// in device mode, a copy of the first message taken on the stream.
struct Side {
  Transport* t = nullptr;
  PeerId peer = 0;
  bool parent = false;
  uint32_t remote = 0, local = 0;  // buffer written, buffer received into
  Memory* src[2] = {nullptr, nullptr};
  Memory* recv = nullptr;
  Memory* first = nullptr;  // device mode only
  cudaStream_t stream = nullptr;
};

// Host-driven: returns the time of the `iters` timed round trips in seconds (parent), after checking
// the first and the last message received. The parent writes first; the child answers.
absl::StatusOr<double> HostRun(const Side& s, size_t bytes, int warmup, int iters, uint64_t* seq,
                               uint64_t want_first, uint64_t want_last) {
  const int total = warmup + iters;
  std::chrono::steady_clock::time_point t0;
  for (int i = 0; i < total; ++i) {
    if (i == warmup) t0 = std::chrono::steady_clock::now();
    ++*seq;
    const absl::Span<const uint8_t> piece(s.src[i == total - 1 ? 1 : 0]->data(), bytes);
    if (s.parent) RETURN_IF_ERROR(s.t->Write(s.peer, s.remote, 0, {&piece, 1}, *seq));
    RETURN_IF_ERROR(s.t->WaitDoorbell(s.local, *seq, In(absl::Seconds(60))));
    if (i == 0) RETURN_IF_ERROR(CheckHash(*s.recv, bytes, want_first, "first message"));
    if (!s.parent) RETURN_IF_ERROR(s.t->Write(s.peer, s.remote, 0, {&piece, 1}, *seq));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  RETURN_IF_ERROR(CheckHash(*s.recv, bytes, want_last, "last message"));
  return seconds;
}

// Device-polled: the whole chain enqueued at once, one SyncStream. Returns the parent's time of the
// timed round trips (CUDA events), 0 on the child.
absl::StatusOr<double> DeviceRun(const Side& s, size_t bytes, int warmup, int iters, uint64_t* seq,
                                 uint64_t want_first, uint64_t want_last) {
  const int total = warmup + iters;
  cudaEvent_t start = nullptr, end = nullptr;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&end));
  absl::Status st;
  for (int i = 0; i < total && st.ok(); ++i) {
    ++*seq;
    const void* src = s.src[i == total - 1 ? 1 : 0]->data();
    const std::string label = absl::StrCat(s.parent ? "parent" : "child", ": message ", *seq);
    if (s.parent) st = s.t->EnqueueWrite(s.peer, s.remote, 0, src, bytes, *seq, s.stream);
    if (st.ok()) {
      st = s.t->EnqueueWait(s.peer, s.local, 0, bytes, *seq, absl::Seconds(60), label, s.stream);
    }
    if (st.ok() && i == 0) {
      BENCH_CUDA(cudaMemcpyAsync(s.first->data(), s.recv->data(), bytes, cudaMemcpyDeviceToDevice, s.stream));
    }
    if (st.ok() && !s.parent) st = s.t->EnqueueWrite(s.peer, s.remote, 0, src, bytes, *seq, s.stream);
    if (i == warmup - 1) BENCH_CUDA(cudaEventRecord(start, s.stream));
  }
  BENCH_CUDA(cudaEventRecord(end, s.stream));
  if (st.ok()) st = s.t->SyncStream(s.stream, In(absl::Seconds(120) + absl::Seconds(1) * total));
  float ms = 0;
  if (st.ok()) BENCH_CUDA(cudaEventElapsedTime(&ms, start, end));
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  RETURN_IF_ERROR(st);
  RETURN_IF_ERROR(CheckHash(*s.first, bytes, want_first, "first message"));
  RETURN_IF_ERROR(CheckHash(*s.recv, bytes, want_last, "last message"));
  return ms * 1e-3;
}

// One side's memory for one kind: registered buffers must outlive the transport, so the transport
// is moved into a variable declared after these (and so destroyed first).
struct Buffers {
  std::unique_ptr<Memory> src[2], recv, first;
  Buffers(const Capabilities& caps, size_t max_bytes) {
    src[0] = std::make_unique<Memory>(caps.gpu_memory, max_bytes);
    src[1] = std::make_unique<Memory>(caps.gpu_memory, max_bytes);
    recv = std::make_unique<Memory>(caps.gpu_memory, max_bytes);
    if (caps.device_polling) first = std::make_unique<Memory>(true, max_bytes);
  }
  Side MakeSide(Transport* t, PeerId peer, bool parent, cudaStream_t stream) {
    Side s;
    s.t = t;
    s.peer = peer;
    s.parent = parent;
    s.remote = parent ? kChildBuffer : kParentBuffer;
    s.local = parent ? kParentBuffer : kChildBuffer;
    s.src[0] = src[0].get();
    s.src[1] = src[1].get();
    s.recv = recv.get();
    s.first = first.get();
    s.stream = stream;
    return s;
  }
};

// ---- The child -----------------------------------------------------------------------------------

absl::Status ChildMain(const Options& o) {
  ASSIGN_OR_RETURN(const TransportKind kind, ParseTransportKind(o.child_kind));
  int gpus = 0;
  BENCH_CUDA(cudaGetDeviceCount(&gpus));
  const int device = gpus >= 2 ? 1 : 0;
  BENCH_CUDA(cudaSetDevice(device));
  ASSIGN_OR_RETURN(std::unique_ptr<Transport> created,
                   CreateTransport({.kind = kind, .listen_address = "", .device = device}));
  const Capabilities caps = created->capabilities();
  Buffers buffers(caps, *std::max_element(o.sizes.begin(), o.sizes.end()));
  std::unique_ptr<Transport> t = std::move(created);  // destroyed before the buffers
  RETURN_IF_ERROR(t->RegisterBuffer(kChildBuffer, buffers.recv->data(),
                                    *std::max_element(o.sizes.begin(), o.sizes.end())));
  ASSIGN_OR_RETURN(const PeerId peer, t->Connect(o.connect));
  RETURN_IF_ERROR(t->Send(peer, Text(absl::StrCat("hello ", device))));
  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Side side = buffers.MakeSide(t.get(), peer, /*parent=*/false, stream);
  uint64_t seq = 0;
  for (size_t bytes : o.sizes) {
    for (int mode : {kHostMode, kDeviceMode}) {
      if (mode == kDeviceMode && !caps.device_polling) continue;
      for (int v = 0; v < 2; ++v) buffers.src[v]->Upload(Payload(o.seed, 1, bytes, mode, v));
      buffers.recv->Zero(bytes);
      const uint64_t want_first = PayloadHash(o.seed, 0, bytes, mode, 0);
      const uint64_t want_last = PayloadHash(o.seed, 0, bytes, mode, 1);
      RETURN_IF_ERROR(t->Send(peer, Text(absl::StrCat("ready ", bytes, " ", mode))));
      absl::StatusOr<double> r = mode == kHostMode
                                     ? HostRun(side, bytes, o.warmup, o.iters, &seq, want_first, want_last)
                                     : DeviceRun(side, bytes, o.warmup, o.iters, &seq, want_first, want_last);
      if (!r.ok()) {
        (void)t->Send(peer, Text(absl::StrCat("bad ", r.status().ToString())));
        return r.status();
      }
      RETURN_IF_ERROR(t->Send(peer, Text(absl::StrCat("ok ", bytes, " ", mode))));
    }
  }
  RETURN_IF_ERROR(Expect(*t, "bye"));
  t->Close(peer);
  t.reset();
  cudaStreamDestroy(stream);
  return absl::OkStatus();
}

// ---- The parent ----------------------------------------------------------------------------------

struct Row {
  size_t bytes = 0;
  double host_us = 0;
  std::optional<double> device_us;
  double gbps = 0, peer_gbps = 0;
};

struct KindResult {
  std::string kind;
  std::string skipped;  // the reason, or empty
  std::string error;    // a failed run, or empty
  int child_device = 0;
  std::vector<Row> rows;
};

pid_t SpawnChild(const Options& o, const std::string& kind, const std::string& address, uint64_t seed) {
  std::string exe(4096, '\0');
  const ssize_t n = readlink("/proc/self/exe", exe.data(), exe.size() - 1);
  if (n <= 0) return -1;
  exe.resize(static_cast<size_t>(n));
  std::string sizes;
  for (size_t b : o.sizes) absl::StrAppend(&sizes, sizes.empty() ? "" : ",", b);
  std::vector<std::string> args = {exe,
                                   "--child",
                                   kind,
                                   address,
                                   absl::StrCat(seed),
                                   "--sizes",
                                   sizes,
                                   "--iters",
                                   absl::StrCat(o.iters),
                                   "--warmup",
                                   absl::StrCat(o.warmup)};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid == 0) {
    execv(exe.c_str(), argv.data());
    _exit(127);
  }
  return pid;
}

// Waits up to `timeout` for the child, then kills it. Its exit status, or -1 if it was killed.
int ReapChild(pid_t child, absl::Duration timeout) {
  const absl::Time until = In(timeout);
  int status = 0;
  while (absl::Now() < until) {
    if (waitpid(child, &status, WNOHANG) == child) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  return -1;
}

// One kind, on `created` (listening, cuda:0).
absl::Status RunKind(const Options& o, std::unique_ptr<Transport> created,
                     const std::vector<double>& peer_gbps, KindResult* result) {
  const std::string name = result->kind;
  const size_t max_bytes = *std::max_element(o.sizes.begin(), o.sizes.end());
  const Capabilities caps = created->capabilities();
  Buffers buffers(caps, max_bytes);
  std::unique_ptr<Transport> t = std::move(created);  // destroyed before the buffers
  RETURN_IF_ERROR(t->RegisterBuffer(kParentBuffer, buffers.recv->data(), max_bytes));
  const uint64_t seed = std::random_device{}() * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(getpid());
  const pid_t child = SpawnChild(o, name, t->address(), seed);
  if (child <= 0) return absl::InternalError("cannot start the child process");
  struct Reaper {  // on an early return, the child goes too
    pid_t pid;
    ~Reaper() {
      if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
      }
    }
  } reaper{child};
  ASSIGN_OR_RETURN(const PeerId peer, t->Accept(In(absl::Seconds(120))));
  ASSIGN_OR_RETURN(const std::string hello, NextMessage(*t));
  if (!absl::StartsWith(hello, "hello ") || !absl::SimpleAtoi(hello.substr(6), &result->child_device)) {
    return absl::InternalError(absl::StrCat("unexpected hello \"", hello, "\""));
  }
  std::fprintf(stderr, "[%s] cuda:0 <-> cuda:%d, gpu_memory %d, device_polling %d\n", name.c_str(),
               result->child_device, caps.gpu_memory, caps.device_polling);
  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Side side = buffers.MakeSide(t.get(), peer, /*parent=*/true, stream);
  uint64_t seq = 0;
  absl::Status st;
  for (size_t si = 0; si < o.sizes.size() && st.ok(); ++si) {
    const size_t bytes = o.sizes[si];
    Row row;
    row.bytes = bytes;
    row.peer_gbps = peer_gbps[si];
    for (int mode : {kHostMode, kDeviceMode}) {
      if (mode == kDeviceMode && !caps.device_polling) continue;
      std::fprintf(stderr, "[%s] %s %s ...\n", name.c_str(), SizeName(bytes).c_str(), kModeNames[mode]);
      for (int v = 0; v < 2; ++v) buffers.src[v]->Upload(Payload(seed, 0, bytes, mode, v));
      buffers.recv->Zero(bytes);
      const uint64_t want_first = PayloadHash(seed, 1, bytes, mode, 0);
      const uint64_t want_last = PayloadHash(seed, 1, bytes, mode, 1);
      st = Expect(*t, absl::StrCat("ready ", bytes, " ", mode));
      if (!st.ok()) break;
      absl::StatusOr<double> seconds =
          mode == kHostMode ? HostRun(side, bytes, o.warmup, o.iters, &seq, want_first, want_last)
                            : DeviceRun(side, bytes, o.warmup, o.iters, &seq, want_first, want_last);
      if (!seconds.ok()) {
        st = tandem::Annotate(seconds.status(), absl::StrCat(SizeName(bytes), " ", kModeNames[mode]));
        break;
      }
      // The child's checks of what it received.
      st = Expect(*t, absl::StrCat("ok ", bytes, " ", mode));
      if (!st.ok()) break;
      const double one_way_us = *seconds / o.iters / 2 * 1e6;
      if (mode == kHostMode) {
        row.host_us = one_way_us;
      } else {
        row.device_us = one_way_us;
      }
    }
    if (!st.ok()) break;
    const double best_us = row.device_us ? std::min(row.host_us, *row.device_us) : row.host_us;
    row.gbps = bytes / best_us / 1e3;
    result->rows.push_back(row);
  }
  if (st.ok()) {
    t->Close(peer);
    st = t->Send(peer, Text("bye"));
  }
  if (!st.ok()) kill(child, SIGKILL);  // it may wait for a message that will not come
  const int status = ReapChild(child, absl::Seconds(60));
  reaper.pid = -1;
  t.reset();
  cudaStreamDestroy(stream);
  RETURN_IF_ERROR(st);
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(absl::StrCat("the child process failed (status ", status, ")"));
  }
  return absl::OkStatus();
}

// Bytes per second of a `bytes` copy cuda:0 -> cuda:1 (cudaMemcpyPeerAsync), or cuda:0 -> cuda:0
// with one GPU; median of `iters` after a warm-up.
double PeerCopyGbps(size_t bytes, int gpus, int iters) {
  const int dst_device = gpus >= 2 ? 1 : 0;
  BENCH_CUDA(cudaSetDevice(0));
  bool peer_enabled = false;
  if (dst_device != 0) {
    int can = 0;
    BENCH_CUDA(cudaDeviceCanAccessPeer(&can, 0, dst_device));
    if (can) {
      BENCH_CUDA(cudaDeviceEnablePeerAccess(dst_device, 0));
      peer_enabled = true;
    }
  }
  void *src = nullptr, *dst = nullptr;
  BENCH_CUDA(cudaMalloc(&src, bytes));
  BENCH_CUDA(cudaMemset(src, 0x5A, bytes));
  BENCH_CUDA(cudaSetDevice(dst_device));
  BENCH_CUDA(cudaMalloc(&dst, bytes));
  BENCH_CUDA(cudaSetDevice(0));
  cudaStream_t s = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  BENCH_CUDA(cudaDeviceSynchronize());
  std::vector<double> times;
  for (int i = 0; i < iters + 3; ++i) {
    BENCH_CUDA(cudaEventRecord(a, s));
    if (dst_device != 0) {
      BENCH_CUDA(cudaMemcpyPeerAsync(dst, dst_device, src, 0, bytes, s));
    } else {
      BENCH_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
    }
    BENCH_CUDA(cudaEventRecord(b, s));
    BENCH_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
    if (i >= 3) times.push_back(ms * 1e-3);
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  BENCH_CUDA(cudaEventDestroy(a));
  BENCH_CUDA(cudaEventDestroy(b));
  BENCH_CUDA(cudaStreamDestroy(s));
  BENCH_CUDA(cudaFree(src));
  BENCH_CUDA(cudaSetDevice(dst_device));
  BENCH_CUDA(cudaFree(dst));
  BENCH_CUDA(cudaSetDevice(0));
  // Left as the transports find it: they enable what they need themselves.
  if (peer_enabled) BENCH_CUDA(cudaDeviceDisablePeerAccess(dst_device));
  return bytes / median / 1e9;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = ParseArgs(argc, argv);
  if (o.child) {
    const absl::Status st = ChildMain(o);
    if (!st.ok()) {
      std::fprintf(stderr, "transport_bench child (%s): %s\n", o.child_kind.c_str(), st.ToString().c_str());
      return 1;
    }
    return 0;
  }
  // The children authenticate with this run's secret (common/bootstrap/deployment_key.h).
  char secret_dir[] = "/tmp/transport-bench-XXXXXX";
  if (mkdtemp(secret_dir) == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  const std::string secret = std::string(secret_dir) + "/secret";
  if (const absl::Status st = tandem::bootstrap::ShareNewKeyWithChildren(secret); !st.ok()) {
    std::fprintf(stderr, "transport_bench: %s\n", st.ToString().c_str());
    return 1;
  }
  struct RemoveSecret {
    std::string file, dir;
    ~RemoveSecret() {
      unlink(file.c_str());
      rmdir(dir.c_str());
    }
  } remove_secret{secret, secret_dir};
  int gpus = 0;
  const cudaError_t count_err = cudaGetDeviceCount(&gpus);
  if (count_err != cudaSuccess || gpus == 0) {
    std::fprintf(stderr, "transport_bench: no usable CUDA device (%s)\n",
                 count_err != cudaSuccess ? cudaGetErrorString(count_err) : "none found");
    return 1;
  }
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  const char* copy_name = gpus >= 2 ? "peer copy cuda:0 -> cuda:1" : "device-to-device copy on cuda:0";
  std::fprintf(stderr, "measuring the %s ...\n", copy_name);
  std::vector<double> peer_gbps;
  for (size_t bytes : o.sizes) peer_gbps.push_back(PeerCopyGbps(bytes, gpus, std::max(o.iters, 20)));

  std::printf(
      "device: %s x %d; warm-up %d, %d timed round trips per size and mode; one-way = round trip / 2\n",
      prop.name, gpus, o.warmup, o.iters);
  std::vector<KindResult> results;
  bool failed = false;
  for (const std::string& name : o.kinds) {
    KindResult r;
    r.kind = name;
    const absl::StatusOr<TransportKind> kind = ParseTransportKind(name);
    if (!kind.ok()) {
      std::fprintf(stderr, "%s\n", std::string(kind.status().message()).c_str());
      return 2;
    }
    if (!TransportBuilt(*kind)) {
      r.skipped = std::string(CreateTransport({.kind = *kind}).status().message());
    } else if (*kind == TransportKind::kNccl && gpus < 2) {
      r.skipped =
          absl::StrCat("nccl needs two GPUs (NCCL refuses two ranks on one GPU); this machine has ", gpus);
    } else {
      BENCH_CUDA(cudaSetDevice(0));
      absl::StatusOr<std::unique_ptr<Transport>> created =
          CreateTransport({.kind = *kind, .listen_address = "127.0.0.1:0", .device = 0});
      absl::Status st = created.status();
      if (absl::IsUnavailable(st)) {
        r.skipped = std::string(st.message());  // no hardware for it here
        st = absl::OkStatus();
      } else if (st.ok()) {
        st = RunKind(o, std::move(*created), peer_gbps, &r);
      }
      if (!st.ok()) {
        r.error = st.ToString();
        failed = true;
      }
    }
    std::printf("\ntransport %s", name.c_str());
    if (!r.skipped.empty()) {
      std::printf(": skipped: %s\n", r.skipped.c_str());
    } else {
      std::printf(": cuda:0 <-> cuda:%d; GB/s = size / the best mode's one-way time\n", r.child_device);
      const char* ref = gpus >= 2 ? "peer copy" : "D2D copy";
      std::printf(
          "| size | host-driven one-way us | device-polled one-way us | GB/s | %s GB/s | %% of %s |\n", ref,
          ref);
      std::printf("|---|---|---|---|---|---|\n");
      for (const Row& row : r.rows) {
        const std::string dev = row.device_us ? absl::StrFormat("%.2f", *row.device_us) : "-";
        std::printf("| %s | %.2f | %s | %.2f | %.1f | %.1f |\n", SizeName(row.bytes).c_str(), row.host_us,
                    dev.c_str(), row.gbps, row.peer_gbps, 100.0 * row.gbps / row.peer_gbps);
      }
      if (!r.error.empty()) std::printf("FAILED: %s\n", r.error.c_str());
    }
    std::fflush(stdout);
    if (!r.error.empty())
      std::fprintf(stderr, "transport_bench: %s FAILED: %s\n", name.c_str(), r.error.c_str());
    results.push_back(std::move(r));
  }

  if (!o.json.empty()) {
    FILE* f = std::fopen(o.json.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", o.json.c_str());
      return 1;
    }
    std::fprintf(f, "{\"device\": %s, \"gpus\": %d, \"warmup\": %d, \"iters\": %d, \"reference\": %s,\n",
                 JsonString(prop.name).c_str(), gpus, o.warmup, o.iters, JsonString(copy_name).c_str());
    std::fprintf(f, " \"reference_gbps\": {");
    for (size_t i = 0; i < o.sizes.size(); ++i) {
      std::fprintf(f, "%s\"%zu\": %.3f", i ? ", " : "", o.sizes[i], peer_gbps[i]);
    }
    std::fprintf(f, "},\n \"kinds\": [");
    for (size_t k = 0; k < results.size(); ++k) {
      const KindResult& r = results[k];
      std::fprintf(f, "%s\n  {\"kind\": %s", k ? "," : "", JsonString(r.kind).c_str());
      if (!r.skipped.empty()) std::fprintf(f, ", \"skipped\": %s", JsonString(r.skipped).c_str());
      if (!r.error.empty()) std::fprintf(f, ", \"error\": %s", JsonString(r.error).c_str());
      std::fprintf(f, ", \"child_device\": %d, \"rows\": [", r.child_device);
      for (size_t i = 0; i < r.rows.size(); ++i) {
        const Row& row = r.rows[i];
        const std::string dev = row.device_us ? absl::StrFormat("%.3f", *row.device_us) : "null";
        std::fprintf(f,
                     "%s\n    {\"bytes\": %zu, \"host_one_way_us\": %.3f, \"device_one_way_us\": %s, "
                     "\"gbps\": %.3f, \"reference_gbps\": %.3f, \"pct_of_reference\": %.2f}",
                     i ? "," : "", row.bytes, row.host_us, dev.c_str(), row.gbps, row.peer_gbps,
                     100.0 * row.gbps / row.peer_gbps);
      }
      std::fprintf(f, "]}");
    }
    std::fprintf(f, "\n ]}\n");
    std::fclose(f);
  }
  return failed ? 1 : 0;
}
