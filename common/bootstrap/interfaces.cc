#include "common/bootstrap/interfaces.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"

namespace tandem::bootstrap {

absl::StatusOr<Interface> ResolveInterface(const std::string& what) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return absl::InternalError("getifaddrs failed");
  std::vector<Interface> all;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char host[INET_ADDRSTRLEN] = "";
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, host, sizeof(host));
    all.push_back({a->ifa_name, host});
  }
  freeifaddrs(list);
  for (const Interface& i : all) {
    if (i.name == what || i.address == what) return i;
  }
  return absl::NotFoundError(absl::StrCat(
      "no network interface of this host is named or has the address \"", what, "\" (this host has: ",
      absl::StrJoin(
          all, ", ",
          [](std::string* out, const Interface& i) { absl::StrAppend(out, i.name, " ", i.address); }),
      ")"));
}

void LimitUcxToInterface(const Interface& iface) {
  const char* set = std::getenv("UCX_NET_DEVICES");
  if (set != nullptr && *set != '\0') {
    TANDEM_LOG_INFO("bootstrap", "UCX_NET_DEVICES=", set, " from the environment (interface ", iface.name,
                    " configured)");
    return;
  }
  setenv("UCX_NET_DEVICES", iface.name.c_str(), 1);
  TANDEM_LOG_DEBUG("bootstrap", "UCX limited to interface ", iface.name, " (", iface.address, ")");
}

}  // namespace tandem::bootstrap
