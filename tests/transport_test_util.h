// Helpers of the transport tests (CUDA-free): payloads that say who wrote them and for which
// message, a hash to compare them by, and a child process of the test binary that runs one of its
// DISABLED_ helper tests with extra environment variables (the parent's address, a transport).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

extern char** environ;

namespace tandem::testing_transport {

// Word i of the payload is a mix of (origin, seq, i): any byte written by another writer, for
// another message or at another place differs with overwhelming probability.
inline std::vector<uint8_t> Payload(uint64_t origin, uint64_t seq, size_t bytes) {
  std::vector<uint8_t> v(bytes);
  for (size_t i = 0; i < bytes; i += 8) {
    uint64_t z = origin * 0x9E3779B97F4A7C15ull + seq * 0xBF58476D1CE4E5B9ull + i;
    z = (z ^ (z >> 31)) * 0x94D049BB133111EBull;
    z ^= z >> 29;
    std::memcpy(v.data() + i, &z, std::min<size_t>(8, bytes - i));
  }
  return v;
}

// 64-bit FNV-1a.
inline uint64_t Fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}
inline uint64_t Fnv1a(const std::vector<uint8_t>& v) { return Fnv1a(v.data(), v.size()); }

inline std::vector<uint8_t> Text(const std::string& s) { return {s.begin(), s.end()}; }

// Starts this test binary again, running only the (disabled) test `test` ("Suite.DISABLED_Name"),
// with `env` ("NAME=value" each) added to the environment (replacing a variable of the same name).
// The child's pid, or -1.
inline pid_t SpawnSelf(const std::string& test, std::vector<std::string> env) {
  std::string exe(4096, '\0');
  const ssize_t n = readlink("/proc/self/exe", exe.data(), exe.size() - 1);
  if (n <= 0) return -1;
  exe.resize(static_cast<size_t>(n));
  std::vector<char*> envp;
  // `env` entries replace this process's variables of the same name (getenv takes the first).
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view var(*e);
    const bool replaced = std::any_of(env.begin(), env.end(), [&](const std::string& x) {
      const size_t eq = x.find('=');
      return eq != std::string::npos && var.substr(0, eq + 1) == std::string_view(x).substr(0, eq + 1);
    });
    if (!replaced) envp.push_back(*e);
  }
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string filter = "--gtest_filter=" + test;
  std::string disabled = "--gtest_also_run_disabled_tests";
  std::vector<char*> argv = {exe.data(), filter.data(), disabled.data(), nullptr};
  const pid_t pid = fork();
  if (pid == 0) {
    execve(exe.c_str(), argv.data(), envp.data());
    _exit(127);
  }
  return pid;
}

}  // namespace tandem::testing_transport
