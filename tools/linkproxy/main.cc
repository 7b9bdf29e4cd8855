// hsbn-linkproxy: forwards TCP from --listen to --target and cuts, stalls or delays the link on
// command (LinkProxy, linkproxy.h). Used between a sidecar and the root: by the fault-injection
// bench (bench/soak) and by LocalCluster's simulated cross-node latency (link_delay_ms). Flags
// are parsed by ParseFlags (linkproxy.cc), which linkproxy_test checks.
#include <signal.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "linkproxy.h"

namespace {

volatile sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

const char kUsage[] =
    "usage: hsbn-linkproxy --target=HOST:PORT [--listen=HOST:PORT] [--delay-ms=MS]\n"
    "                      [--delay-up-ms=MS] [--delay-down-ms=MS] [--delay-us=US]\n"
    "                      [--delay-up-us=US] [--delay-down-us=US] [--control=PATH|-]\n"
    "                      [--ready-file=PATH]\n"
    "\n"
    "Forwards every TCP connection accepted on --listen (default 127.0.0.1:0, a free port) to\n"
    "--target, and cuts, stalls or delays the link on command. hsbn puts it between a sidecar\n"
    "(--upstream=the proxy) and the root to simulate cross-node latency and to inject faults.\n"
    "\n"
    "  --target=HOST:PORT    where connections are forwarded (the root aggregator)\n"
    "  --listen=HOST:PORT    where to accept them (port 0: any free port)\n"
    "  --delay-ms=MS         one-way delay in both directions from the start, in ms, in\n"
    "                        [0, 600000] (default 0)\n"
    "  --delay-up-ms=MS      ... of the up direction only (client -> target)\n"
    "  --delay-down-ms=MS    ... of the down direction only (target -> client)\n"
    "  --delay-us=US         the same three in microseconds, in [0, 600000000]: the wait is\n"
    "  --delay-up-us=US      sub-millisecond (100 is ~100 us, not a whole ms). A direction's\n"
    "  --delay-down-us=US    delay is given in ms or in us, not both (--delay-ms with\n"
    "                        --delay-up-us is an error)\n"
    "  --control=PATH        read commands from connections to this Unix socket (one answer\n"
    "                        line per command line); '-' reads them from stdin and answers on\n"
    "                        stdout (EOF on stdin ends the proxy). Default: stdin.\n"
    "  --ready-file=PATH     once listening, write the bound HOST:PORT and a newline here\n"
    "  --help                this text\n"
    "\n";

}  // namespace

int main(int argc, char** argv) {
  using hsbn::linkproxy::LinkProxy;
  hsbn::linkproxy::Flags flags;
  std::string error;
  if (!hsbn::linkproxy::ParseFlags(std::vector<std::string>(argv + 1, argv + argc), &flags,
                                   &error)) {
    std::fprintf(stderr, "hsbn-linkproxy: %s\n\n%s", error.c_str(), kUsage);
    return 2;
  }
  if (flags.help) {
    std::fputs(kUsage, stdout);
    std::fputs(LinkProxy::Help(), stdout);
    return 0;
  }
  const hsbn::linkproxy::Options& opt = flags.options;
  // The loop sleeps until the next held chunk is due (ppoll, ns timeout); the default 50 us
  // timer slack would let a 100 us delay last up to 150 us.
  prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
  signal(SIGPIPE, SIG_IGN);
  struct sigaction sa {};
  sa.sa_handler = OnSignal;  // no SA_RESTART: ppoll() returns, and the loop checks g_stop
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  auto proxy = LinkProxy::Create(opt, &error);
  if (!proxy) {
    std::fprintf(stderr, "hsbn-linkproxy: %s\n", error.c_str());
    return 1;
  }
  if (flags.control == "-") {
    proxy->AddControlFd(0, 1);
  } else if (!proxy->AddControlSocket(flags.control, &error)) {
    std::fprintf(stderr, "hsbn-linkproxy: %s\n", error.c_str());
    return 1;
  }
  const std::string& ready = flags.ready;
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
