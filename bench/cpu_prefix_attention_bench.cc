// CPU cascade (shared-prefix) attention against plain attention for decode rows: from which
// shared prefix length does the CPU executor's cascade path pay? Not a test: prints figures.
//
//   cpu_prefix_attention_bench [--shapes 8/2/64,32/8/128] [--groups 1,2,4,8,16,32,64]
//                              [--prefixes 16,32,64,128,256,512,1024,4096] [--suffix 32] [--reps N]
//
// A group of G decode rows (one query row per request) shares a prefix of P keys; each row also
// has S keys of its own (its suffix, its newest key included). One layer's fp32 KV pool of
// P + G·S slots in a random permutation (no context is contiguous), K/V filled with fresh random
// values per configuration, magnitudes in [1/16, 1) with random signs (never zeros), q with
// magnitudes in [1/16, 2.5) (scores of std ≈ 0.85: the softmax neither flat nor one-hot).
//   plain    one cpu::Attention over the G requests, each over its whole context (the P prefix
//            slots, then its S own slots), no lse: what the CPU executor runs without a group.
//   cascade  exactly what CpuAttentionExecutor::Layer runs for one cascade group: cpu::Attention
//            over each row's S own keys with lse, a memcpy gather of the G rows' q, one
//            cpu::PrefixAttention over the P prefix slots for the G rows, then one
//            cpu::MergeAttentionStates (rows = 1, in place) per row.
// The q copy and KV writes that both paths of the executor make are not timed. Each figure is
// the median wall time (std::chrono::steady_clock) of up to --reps runs (default 201) after
// warm-up runs (3 when a pair of runs takes under 10 ms, else 1); a configuration gets about 1 s
// of timed pairs at most, so one whose pair takes more than 1 s / --reps gets fewer runs (at
// least 3). Plain and cascade runs alternate, so both see the same machine state. Caches are not
// flushed between runs (a real step reads the other layers' KV in between): a cold cache would
// add the misses of one first pass over the prefix and the suffixes to both paths alike.
// Figures of a few tens of µs are dominated by the thread pool's wake-ups and vary from run to
// run on a loaded or virtualised machine; compare the crossovers of a few runs.
// Once per configuration the two outputs are compared: max |plain - cascade| is printed; a
// difference >= 1e-4 or a non-finite value prints a MISMATCH line and makes the exit status 1.
//
// Threads: the CPU kernels take no thread count; they share one process-wide pool sized from
// std::thread::hardware_concurrency(), or TANDEM_CPU_THREADS=<n> when set (read once, at first
// use). The count is printed; run with TANDEM_CPU_THREADS=1 for the serial figures.
//
// Output: one row per (shape, G, P): plain µs, cascade µs, speedup plain / cascade, runs,
// max|diff|; then, per shape and G, the smallest P at which the cascade is faster and stays
// faster at every larger P tested. Progress goes to stderr.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/ops.h"

namespace {

namespace cpu = ::tandem::kernels::cpu;

constexpr double kMaxDiff = 1e-4;
constexpr double kConfigBudgetS = 1.0;  // timed runs per configuration, roughly
constexpr int kMinReps = 3;

struct Shape {
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  std::string Name() const {
    return std::to_string(heads) + "/" + std::to_string(kv_heads) + "/" + std::to_string(head_dim);
  }
};

struct Options {
  std::vector<Shape> shapes = {{8, 2, 64}, {32, 8, 128}};
  std::vector<int64_t> groups = {1, 2, 4, 8, 16, 32, 64};
  std::vector<int64_t> prefixes = {16, 32, 64, 128, 256, 512, 1024, 4096};
  int64_t suffix = 32;
  int reps = 201;
};

void Check(const absl::Status& st, const char* what) {
  if (!st.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, st.ToString().c_str());
    std::exit(1);
  }
}

// splitmix64: a fast generator for the large K/V fills.
uint64_t Mix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Values with magnitude in [lo, hi) and a random sign: never zero.
void Fill(std::vector<float>& v, float lo, float hi, uint64_t seed) {
  uint64_t state = seed;
  for (float& x : v) {
    const uint64_t z = Mix(state);
    const float u = static_cast<float>(z >> 40) * 0x1p-24f;  // [0, 1)
    const float mag = lo + (hi - lo) * u;
    x = (z & 1) ? -mag : mag;
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The thread count the kernels' pool uses (kernels/cpu/parallel.h, DefaultThreads).
int PoolThreads(bool* from_env) {
  int n = static_cast<int>(std::thread::hardware_concurrency());
  *from_env = false;
  if (const char* env = std::getenv("TANDEM_CPU_THREADS")) {
    const int v = std::atoi(env);
    if (v > 0) {
      n = v;
      *from_env = true;
    }
  }
  return std::clamp(n, 1, 256);
}

std::string CpuName() {
  FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (f == nullptr) return "unknown CPU";
  char line[512];
  std::string name = "unknown CPU";
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::strncmp(line, "model name", 10) == 0) {
      const char* colon = std::strchr(line, ':');
      if (colon != nullptr) {
        name = colon + 1;
        name.erase(0, name.find_first_not_of(" \t"));
        while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
      }
      break;
    }
  }
  std::fclose(f);
  return name;
}

// One configuration: inputs, both paths, and the scratch the executor keeps between steps.
class Config {
 public:
  Config(const Shape& shape, int64_t g, int64_t p, int64_t s, uint64_t seed)
      : sh_(shape), G_(g), P_(p), S_(s), num_slots_(p + g * s) {
    const int64_t kvd = sh_.kv_heads * sh_.head_dim, qd = sh_.heads * sh_.head_dim;
    k_.resize(static_cast<size_t>(num_slots_ * kvd));
    v_.resize(k_.size());
    q_.resize(static_cast<size_t>(G_ * qd));
    Fill(k_, 1.0f / 16, 1.0f, seed * 4 + 1);
    Fill(v_, 1.0f / 16, 1.0f, seed * 4 + 2);
    Fill(q_, 1.0f / 16, 2.5f, seed * 4 + 3);
    scale_ = 1.0f / std::sqrt(static_cast<float>(sh_.head_dim));

    // Slot pool in a random permutation: the prefix takes the first P, row r's suffix the next S.
    std::vector<int32_t> perm(static_cast<size_t>(num_slots_));
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937_64 rng(seed);
    std::shuffle(perm.begin(), perm.end(), rng);
    prefix_slots_.assign(perm.begin(), perm.begin() + P_);
    q_indptr_.resize(static_cast<size_t>(G_ + 1));
    full_indptr_.resize(static_cast<size_t>(G_ + 1));
    suffix_indptr_.resize(static_cast<size_t>(G_ + 1));
    for (int64_t r = 0; r <= G_; ++r) {
      q_indptr_[static_cast<size_t>(r)] = static_cast<int32_t>(r);
      full_indptr_[static_cast<size_t>(r)] = static_cast<int32_t>(r * (P_ + S_));
      suffix_indptr_[static_cast<size_t>(r)] = static_cast<int32_t>(r * S_);
    }
    for (int64_t r = 0; r < G_; ++r) {
      const auto own = perm.begin() + P_ + r * S_;
      full_slots_.insert(full_slots_.end(), prefix_slots_.begin(), prefix_slots_.end());
      full_slots_.insert(full_slots_.end(), own, own + S_);
      suffix_slots_.insert(suffix_slots_.end(), own, own + S_);
      group_rows_.push_back(static_cast<int32_t>(r));  // the whole batch is one group
    }
    plain_out_.resize(q_.size());
    cascade_out_.resize(q_.size());
    lse_.resize(static_cast<size_t>(G_ * sh_.heads));
    group_q_.resize(q_.size());
    group_out_.resize(q_.size());
    group_lse_.resize(lse_.size());
  }

  void Plain() {
    Check(cpu::Attention({.q = q_.data(),
                          .k_cache = k_.data(),
                          .v_cache = v_.data(),
                          .out = plain_out_.data(),
                          .lse = nullptr,
                          .q_indptr = q_indptr_.data(),
                          .kv_indptr = full_indptr_.data(),
                          .kv_slots = full_slots_.data(),
                          .num_requests = G_,
                          .num_slots = num_slots_,
                          .num_heads = sh_.heads,
                          .num_kv_heads = sh_.kv_heads,
                          .head_dim = sh_.head_dim,
                          .scale = scale_}),
          "Attention (plain)");
  }

  // As CpuAttentionExecutor::Layer for a batch that is one cascade group.
  void Cascade() {
    const int64_t qd = sh_.heads * sh_.head_dim, heads = sh_.heads;
    float* o = cascade_out_.data();
    Check(cpu::Attention({.q = q_.data(),
                          .k_cache = k_.data(),
                          .v_cache = v_.data(),
                          .out = o,
                          .lse = lse_.data(),
                          .q_indptr = q_indptr_.data(),
                          .kv_indptr = suffix_indptr_.data(),
                          .kv_slots = suffix_slots_.data(),
                          .num_requests = G_,
                          .num_slots = num_slots_,
                          .num_heads = heads,
                          .num_kv_heads = sh_.kv_heads,
                          .head_dim = sh_.head_dim,
                          .scale = scale_}),
          "Attention (suffix)");
    const int64_t n = static_cast<int64_t>(group_rows_.size());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = group_rows_[static_cast<size_t>(i)];
      std::memcpy(group_q_.data() + i * qd, q_.data() + row * qd, static_cast<size_t>(qd) * sizeof(float));
    }
    Check(cpu::PrefixAttention({.q = group_q_.data(),
                                .k_cache = k_.data(),
                                .v_cache = v_.data(),
                                .prefix_slots = prefix_slots_.data(),
                                .out = group_out_.data(),
                                .lse = group_lse_.data(),
                                .rows = n,
                                .prefix_len = P_,
                                .num_slots = num_slots_,
                                .num_heads = heads,
                                .num_kv_heads = sh_.kv_heads,
                                .head_dim = sh_.head_dim,
                                .scale = scale_}),
          "PrefixAttention");
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = group_rows_[static_cast<size_t>(i)];
      Check(cpu::MergeAttentionStates({.out_a = o + row * qd,
                                       .lse_a = lse_.data() + row * heads,
                                       .out_b = group_out_.data() + i * qd,
                                       .lse_b = group_lse_.data() + i * heads,
                                       .out = o + row * qd,
                                       .lse = lse_.data() + row * heads,
                                       .rows = 1,
                                       .num_heads = heads,
                                       .head_dim = sh_.head_dim}),
            "MergeAttentionStates");
    }
  }

  // max |plain - cascade| over every output value; infinity if any value is not finite.
  double MaxDiff() const {
    double worst = 0;
    for (size_t i = 0; i < plain_out_.size(); ++i) {
      const float a = plain_out_[i], b = cascade_out_[i];
      if (!std::isfinite(a) || !std::isfinite(b)) return INFINITY;
      worst = std::max(worst, static_cast<double>(std::fabs(a - b)));
    }
    return worst;
  }

 private:
  Shape sh_;
  int64_t G_, P_, S_, num_slots_;
  float scale_ = 0;
  std::vector<float> k_, v_, q_;
  std::vector<int32_t> prefix_slots_, q_indptr_, full_indptr_, full_slots_, suffix_indptr_, suffix_slots_,
      group_rows_;
  std::vector<float> plain_out_, cascade_out_, lse_, group_q_, group_out_, group_lse_;
};

template <typename F>
double TimeSeconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Result {
  double plain_us = 0, cascade_us = 0, max_diff = 0;
  int reps = 0;
};

Result Measure(Config& c, int max_reps) {
  Result r;
  // First warm-up pair: also the run whose outputs are compared, and the cost estimate.
  const double tp = TimeSeconds([&] { c.Plain(); });
  const double tc = TimeSeconds([&] { c.Cascade(); });
  r.max_diff = c.MaxDiff();
  const double pair = tp + tc;
  if (pair < 0.01) {
    for (int i = 0; i < 2; ++i) {
      c.Plain();
      c.Cascade();
    }
  }
  r.reps = static_cast<int>(std::clamp<double>(std::floor(kConfigBudgetS / std::max(pair, 1e-9)), kMinReps,
                                               std::max(max_reps, kMinReps)));
  std::vector<double> plain, cascade;
  for (int i = 0; i < r.reps; ++i) {
    // Alternate which path goes first, so neither always follows the other.
    if (i % 2 == 0) {
      plain.push_back(TimeSeconds([&] { c.Plain(); }));
      cascade.push_back(TimeSeconds([&] { c.Cascade(); }));
    } else {
      cascade.push_back(TimeSeconds([&] { c.Cascade(); }));
      plain.push_back(TimeSeconds([&] { c.Plain(); }));
    }
  }
  r.plain_us = Median(plain) * 1e6;
  r.cascade_us = Median(cascade) * 1e6;
  return r;
}

std::vector<int64_t> ParseList(const char* s, const char* flag) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    const long long x = std::atoll(item.c_str());
    if (x <= 0) {
      std::fprintf(stderr, "%s: %s is not a positive integer\n", flag, item.c_str());
      std::exit(2);
    }
    v.push_back(x);
  }
  if (v.empty()) {
    std::fprintf(stderr, "%s: empty list\n", flag);
    std::exit(2);
  }
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

std::vector<Shape> ParseShapes(const char* s) {
  std::vector<Shape> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    Shape sh;
    long long h = 0, kvh = 0, d = 0;
    if (std::sscanf(item.c_str(), "%lld/%lld/%lld", &h, &kvh, &d) != 3 || h <= 0 || kvh <= 0 || d <= 0 ||
        h % kvh != 0) {
      std::fprintf(stderr, "--shapes: %s is not heads/kv_heads/head_dim (heads a multiple of kv_heads)\n",
                   item.c_str());
      std::exit(2);
    }
    sh.heads = h;
    sh.kv_heads = kvh;
    sh.head_dim = d;
    v.push_back(sh);
  }
  if (v.empty()) {
    std::fprintf(stderr, "--shapes: empty list\n");
    std::exit(2);
  }
  return v;
}

void Usage(const char* argv0, FILE* f) {
  std::fprintf(f,
               "usage: %s [--shapes 8/2/64,32/8/128] [--groups 1,2,4,8,16,32,64]\n"
               "  [--prefixes 16,32,64,128,256,512,1024,4096] [--suffix 32] [--reps 201]\n"
               "  shapes are heads/kv_heads/head_dim; --reps is the most timed runs per configuration\n"
               "  (about 1 s of runs at most, at least 3). Threads: set TANDEM_CPU_THREADS=<n>\n"
               "  (default: hardware threads).\n",
               argv0);
}

Options ParseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--shapes" && has_value) {
      o.shapes = ParseShapes(argv[++i]);
    } else if (a == "--groups" && has_value) {
      o.groups = ParseList(argv[++i], "--groups");
    } else if (a == "--prefixes" && has_value) {
      o.prefixes = ParseList(argv[++i], "--prefixes");
    } else if (a == "--suffix" && has_value) {
      o.suffix = std::atoll(argv[++i]);
      if (o.suffix <= 0) {
        std::fprintf(stderr, "--suffix must be positive (a decode row's own keys include its newest)\n");
        std::exit(2);
      }
    } else if (a == "--reps" && has_value) {
      o.reps = std::max(kMinReps, std::atoi(argv[++i]));
    } else {
      const bool help = a == "--help" || a == "-h";
      Usage(argv[0], help ? stdout : stderr);
      std::exit(help ? 0 : 2);
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = ParseArgs(argc, argv);
  bool threads_from_env = false;
  const int threads = PoolThreads(&threads_from_env);
  std::printf("cpu: %s; kernel threads: %d (%s)\n", CpuName().c_str(), threads,
              threads_from_env ? "TANDEM_CPU_THREADS" : "hardware threads; TANDEM_CPU_THREADS unset");
  std::printf(
      "G decode rows sharing P prefix keys, + S = %lld own keys each; fp32, slots in a random permutation\n"
      "  plain:   Attention over each row's P + S keys\n"
      "  cascade: Attention over each row's S keys with lse + q gather + PrefixAttention (G rows, P keys)\n"
      "           + MergeAttentionStates per row (as CpuAttentionExecutor)\n"
      "  medians of up to %d wall-clock runs after warm-up; speedup = plain / cascade\n\n",
      static_cast<long long>(opt.suffix), opt.reps);
  std::printf("%-10s %3s %5s | %10s %10s %8s %-7s | %4s %9s\n", "shape", "G", "P", "plain_us", "cascade_us",
              "speedup", "faster", "runs", "max|diff|");

  struct Summary {
    std::string shape;
    int64_t g = 0;
    std::vector<int64_t> win_ps;  // every P at which the cascade won
    int64_t stable_win = -1;      // smallest P from which every larger P tested wins
  };
  std::vector<Summary> summary;
  bool all_ok = true;
  uint64_t seed = 1;
  const size_t total = opt.shapes.size() * opt.groups.size() * opt.prefixes.size();
  size_t done = 0;
  const auto start = std::chrono::steady_clock::now();
  for (const Shape& sh : opt.shapes) {
    for (int64_t g : opt.groups) {
      Summary sm{sh.Name(), g};
      std::vector<bool> wins;
      for (int64_t p : opt.prefixes) {
        ++done;
        std::fprintf(stderr, "[%zu/%zu] %s G=%lld P=%lld (%.0f s)\n", done, total, sh.Name().c_str(),
                     static_cast<long long>(g), static_cast<long long>(p),
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        Config c(sh, g, p, opt.suffix, seed++);
        const Result r = Measure(c, opt.reps);
        const bool win = r.cascade_us < r.plain_us;
        wins.push_back(win);
        if (win) sm.win_ps.push_back(p);
        const bool ok = r.max_diff < kMaxDiff;
        all_ok = all_ok && ok;
        std::printf("%-10s %3lld %5lld | %10.1f %10.1f %7.2fx %-7s | %4d %9.1e\n", sh.Name().c_str(),
                    static_cast<long long>(g), static_cast<long long>(p), r.plain_us, r.cascade_us,
                    r.plain_us / r.cascade_us, win ? "cascade" : "plain", r.reps, r.max_diff);
        if (!ok) {
          std::printf("*** MISMATCH: %s G=%lld P=%lld: max|plain - cascade| = %.3e (limit %.0e) ***\n",
                      sh.Name().c_str(), static_cast<long long>(g), static_cast<long long>(p), r.max_diff,
                      kMaxDiff);
        }
        std::fflush(stdout);
      }
      for (size_t i = wins.size(); i-- > 0 && wins[i];) sm.stable_win = opt.prefixes[i];
      summary.push_back(sm);
    }
  }

  std::printf(
      "\nsmallest prefix P from which the cascade is faster at every larger P tested (P: %lld..%lld, S = "
      "%lld):\n",
      static_cast<long long>(opt.prefixes.front()), static_cast<long long>(opt.prefixes.back()),
      static_cast<long long>(opt.suffix));
  std::printf("  %-10s %3s  %s\n", "shape", "G", "cascade faster");
  for (const Summary& sm : summary) {
    std::string col = sm.stable_win < 0 ? "never" : "P >= " + std::to_string(sm.stable_win);
    std::string isolated;  // wins below the stable range, if any
    for (int64_t p : sm.win_ps) {
      if (sm.stable_win < 0 || p < sm.stable_win)
        isolated += (isolated.empty() ? "" : ", ") + std::to_string(p);
    }
    if (!isolated.empty()) col += " (also faster at P = " + isolated + ")";
    std::printf("  %-10s %3lld  %s\n", sm.shape.c_str(), static_cast<long long>(sm.g), col.c_str());
  }
  std::fprintf(stderr, "done in %.0f s\n",
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  if (!all_ok) std::printf("\n*** MISMATCH in at least one configuration (see above) ***\n");
  return all_ok ? 0 : 1;
}
