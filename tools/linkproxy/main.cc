// hsbn-linkproxy: forwards TCP from --listen to --target and cuts, stalls or delays the link on
// command (LinkProxy, linkproxy.h). Used between a sidecar and the root: by the fault-injection
// bench (bench/soak) and by LocalCluster's simulated cross-node latency (link_delay_ms).
#include <signal.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "linkproxy.h"

namespace {

volatile sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

const char kUsage[] =
    "usage: hsbn-linkproxy --target=HOST:PORT [--listen=HOST:PORT] [--delay-ms=MS]\n"
    "                      [--delay-up-ms=MS] [--delay-down-ms=MS] [--control=PATH|-]\n"
    "                      [--ready-file=PATH]\n"
    "\n"
    "Forwards every TCP connection accepted on --listen (default 127.0.0.1:0, a free port) to\n"
    "--target, and cuts, stalls or delays the link on command. hsbn puts it between a sidecar\n"
    "(--upstream=the proxy) and the root to simulate cross-node latency and to inject faults.\n"
    "\n"
    "  --target=HOST:PORT    where connections are forwarded (the root aggregator)\n"
    "  --listen=HOST:PORT    where to accept them (port 0: any free port)\n"
    "  --delay-ms=MS         one-way delay in both directions from the start (default 0)\n"
    "  --delay-up-ms=MS      ... of the up direction only (client -> target)\n"
    "  --delay-down-ms=MS    ... of the down direction only (target -> client)\n"
    "  --control=PATH        read commands from connections to this Unix socket (one answer\n"
    "                        line per command line); '-' reads them from stdin and answers on\n"
    "                        stdout (EOF on stdin ends the proxy). Default: stdin.\n"
    "  --ready-file=PATH     once listening, write the bound HOST:PORT and a newline here\n"
    "  --help                this text\n"
    "\n";

bool Flag(const char* arg, const char* name, std::string* value) {
  const size_t n = std::strlen(name);
  if (std::strncmp(arg, name, n) != 0 || arg[n] != '=') return false;
  *value = arg + n + 1;
  return true;
}

// A delay flag in ms; `out` gets it in µs.
bool Ms(const std::string& flag, const std::string& v, int64_t* out) {
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || x < 0 || x > 600000) {
    std::fprintf(stderr, "hsbn-linkproxy: %s must be an integer in [0, 600000], got '%s'\n",
                 flag.c_str(), v.c_str());
    return false;
  }
  *out = x * 1000;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  using hsbn::linkproxy::LinkProxy;
  hsbn::linkproxy::Options opt;
  std::string control = "-", ready, v;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (std::strcmp(a, "--help") == 0 || std::strcmp(a, "-h") == 0) {
      std::fputs(kUsage, stdout);
      std::fputs(LinkProxy::Help(), stdout);
      return 0;
    } else if (Flag(a, "--target", &v)) {
      opt.target = v;
    } else if (Flag(a, "--listen", &v)) {
      opt.listen = v;
    } else if (Flag(a, "--delay-ms", &v)) {
      if (!Ms("--delay-ms", v, &opt.delay_up_us)) return 2;
      opt.delay_down_us = opt.delay_up_us;
    } else if (Flag(a, "--delay-up-ms", &v)) {
      if (!Ms("--delay-up-ms", v, &opt.delay_up_us)) return 2;
    } else if (Flag(a, "--delay-down-ms", &v)) {
      if (!Ms("--delay-down-ms", v, &opt.delay_down_us)) return 2;
    } else if (Flag(a, "--control", &v)) {
      control = v;
    } else if (Flag(a, "--ready-file", &v)) {
      ready = v;
    } else {
      std::fprintf(stderr, "hsbn-linkproxy: unknown argument '%s'\n\n%s", a, kUsage);
      return 2;
    }
  }
  if (opt.target.empty()) {
    std::fprintf(stderr, "hsbn-linkproxy: --target is required\n\n%s", kUsage);
    return 2;
  }
  // The loop sleeps until the next held chunk is due (ppoll, ns timeout); the default 50 us
  // timer slack would let a 100 us delay last up to 150 us.
  prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
  signal(SIGPIPE, SIG_IGN);
  struct sigaction sa {};
  sa.sa_handler = OnSignal;  // no SA_RESTART: ppoll() returns, and the loop checks g_stop
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  std::string error;
  auto proxy = LinkProxy::Create(opt, &error);
  if (!proxy) {
    std::fprintf(stderr, "hsbn-linkproxy: %s\n", error.c_str());
    return 1;
  }
  if (control == "-") {
    proxy->AddControlFd(0, 1);
  } else if (!proxy->AddControlSocket(control, &error)) {
    std::fprintf(stderr, "hsbn-linkproxy: %s\n", error.c_str());
    return 1;
  }
  if (!ready.empty()) {
    const std::string tmp = ready + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "w");
    if (f == nullptr || std::fprintf(f, "%s\n", proxy->address().c_str()) < 0 ||
        std::fclose(f) != 0 || std::rename(tmp.c_str(), ready.c_str()) != 0) {
      std::fprintf(stderr, "hsbn-linkproxy: cannot write --ready-file %s\n", ready.c_str());
      return 1;
    }
  }
  std::fprintf(stderr, "hsbn-linkproxy: %s -> %s\n", proxy->address().c_str(),
               opt.target.c_str());
  while (!g_stop && proxy->Step(-1)) {
  }
  return 0;
}
