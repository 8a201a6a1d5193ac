#include "common/host_memory.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"

namespace tandem {

int64_t AvailableHostBytes(std::string* from) {
  std::string unused;
  if (from == nullptr) from = &unused;
  int64_t avail = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  *from = "physical memory";
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    int64_t kb = 0;
    if (absl::StartsWith(line, "MemAvailable:") &&
        absl::SimpleAtoi(absl::StripSuffix(absl::StripAsciiWhitespace(line.substr(13)), " kB"), &kb)) {
      avail = std::min(avail, kb * 1024);
      *from = "MemAvailable";
    }
  }
  std::ifstream max_file("/sys/fs/cgroup/memory.max"), cur_file("/sys/fs/cgroup/memory.current");
  std::string max_text, cur_text;
  int64_t max = 0, cur = 0;
  if (max_file >> max_text && cur_file >> cur_text && absl::SimpleAtoi(max_text, &max) &&
      absl::SimpleAtoi(cur_text, &cur) && max - cur < avail) {
    avail = std::max<int64_t>(0, max - cur);
    *from = "cgroup memory.max";
  }
  return avail;
}

}  // namespace tandem
