// tools/linkproxy/linkproxy.h — a TCP forwarder that can cut, stall or delay a link on command.
//
// LinkProxy listens on one address and forwards every accepted connection to one target (in
// hsbn: a sidecar's upstream link to the root). Commands, one per line (see Help()), change
// how it forwards:
//   forward   normal forwarding (the start state; also `resume`)
//   drop      reset (RST) every open connection and reset every new one until `resume`
//   reset     reset every open connection once; new ones are forwarded
//   stall     stop reading and writing every connection, keeping them open, until `resume`
//   delay U [D]  hold each chunk read in the up direction (client -> target) U ms and in the
//             down direction D ms (default U) before writing it on; chunks are timestamped
//             when read, so the delay adds latency without serializing throughput
//   delay-us U [D]  the same in microseconds
//   stats     one line of key=value counters; stats-reset zeroes the traffic counters
//
// Everything runs on the thread that calls Run(): a single ppoll() loop over the listener,
// the control channel and every connection. Not thread-safe; Command() may be called between
// iterations (tests) or arrives on the control socket / stdin.
//
// Delays and due times are kept in microseconds of steady_clock, and the loop sleeps until the
// next chunk is due with ppoll()'s nanosecond timeout, so a 100 µs delay is ~100 µs (plus the
// kernel's wake-up latency and the thread's timer slack: hsbn-linkproxy sets its slack to 1 ns;
// a thread left at the default 50 µs may wake up to 50 µs late), never rounded to whole ms.
#ifndef HSBN_TOOLS_LINKPROXY_LINKPROXY_H_
#define HSBN_TOOLS_LINKPROXY_LINKPROXY_H_

#include <time.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

namespace hsbn::linkproxy {

// The longest delay, in each unit: 10 minutes.
constexpr int64_t kMaxDelayMs = 600000;
constexpr int64_t kMaxDelayUs = kMaxDelayMs * 1000;

// Counters of one direction of the link, over every connection since start or stats-reset.
struct DirectionStats {
  int64_t bytes = 0;   // bytes written on to the far side
  int64_t chunks = 0;  // chunks (reads) written on
  // How long each chunk was held between its read and the start of its write, in µs.
  int64_t held_min_us = -1;  // -1: no chunk yet
  int64_t held_max_us = 0;
  int64_t held_sum_us = 0;
};

struct Stats {
  std::string mode;         // forward, drop or stall
  int64_t open = 0;         // connections open now
  int64_t accepted = 0;     // connections accepted and forwarded
  int64_t refused = 0;      // connections reset at once (drop mode, or the target refused)
  int64_t reset = 0;        // open connections reset by drop/reset
  int64_t delay_up_us = 0;  // the delays now (stats also shows them in whole ms)
  int64_t delay_down_us = 0;
  DirectionStats up, down;  // up: client -> target
};

struct Options {
  std::string listen = "127.0.0.1:0";  // host:port
  std::string target;                  // host:port
  int64_t delay_up_us = 0;             // [0, kMaxDelayUs]
  int64_t delay_down_us = 0;
  // Reading stops on a side whose other direction holds this many bytes not yet written.
  int64_t max_queued_bytes = 8 << 20;
};

class LinkProxy {
 public:
  // Binds the listener. Errors are returned as text in `error`; nullptr then.
  static std::unique_ptr<LinkProxy> Create(const Options& options, std::string* error);
  ~LinkProxy();

  // The bound address, host:port.
  std::string address() const;

  // Adds a control channel: lines read from `fd` are commands, answers go to `out_fd`
  // (the same fd for a socket). A listening Unix socket path is served with AddControlSocket.
  void AddControlFd(int in_fd, int out_fd);
  bool AddControlSocket(const std::string& path, std::string* error);

  // Runs one command line; returns the answer line (without newline): "ok ..." or "error ...".
  std::string Command(const std::string& line);

  // One iteration of the loop: waits up to `timeout_ms` (-1: until something happens, or the
  // next held chunk is due) and handles what is ready. Returns false once `quit` was received.
  bool Step(int timeout_ms);
  // Steps until `quit`, or until stdin (when a control fd) reaches EOF.
  void Run();

  Stats GetStats() const;
  static std::string FormatStats(const Stats& s);
  static const char* Help();

 private:
  struct Chunk;
  struct Direction;
  struct Conn;
  struct Control;
  explicit LinkProxy(const Options& options);

  void Accept();
  void StartConnect(int client_fd);
  void ResetConn(Conn& c);
  void CloseConn(Conn& c);
  void ReadInto(Conn& c, bool up);
  void WriteFrom(Conn& c, bool up);
  void FinishDirections(Conn& c);
  void ServeControl(Control& ctl);

  Options options_;
  std::string mode_ = "forward";
  int listen_fd_ = -1;
  int control_listen_fd_ = -1;
  std::string control_path_;
  std::string bound_;
  std::vector<std::unique_ptr<Conn>> conns_;
  std::vector<std::unique_ptr<Control>> controls_;
  Stats stats_;
  bool quit_ = false;
};

// "host:port" -> parts; false if malformed.
bool SplitHostPort(const std::string& s, std::string* host, std::string* port);

// When a chunk read at `read_us` (steady_clock, µs) on a direction with `delay_us` may be
// written on: `delay_us` after its read, but never before the chunk read before it
// (`previous_due_us`), so a delay lowered while chunks are held keeps their order.
int64_t DueUs(int64_t read_us, int64_t delay_us, int64_t previous_due_us);

// How long the loop may wait at `now_us`: until `wake_us` (the earliest due chunk; -1: none),
// and at most `timeout_ms` (-1: no limit). -1 (forever) or a wait in µs, 0 if already due.
int64_t WaitUs(int64_t now_us, int64_t wake_us, int timeout_ms);

// A wait in µs as ppoll()'s timeout: nullptr (forever) for -1, else `ts` filled in.
const timespec* WaitTimespec(int64_t wait_us, timespec* ts);

// hsbn-linkproxy's command line (main.cc), parsed and checked.
struct Flags {
  Options options;
  std::string control = "-";  // --control: a Unix socket path, or "-" for stdin/stdout
  std::string ready;          // --ready-file
  bool help = false;          // --help or -h: print the usage and exit
};
// Parses `args` (argv without argv[0]) into `flags`. A delay may be given in ms (--delay-ms,
// --delay-up-ms, --delay-down-ms: [0, kMaxDelayMs]) or µs (--delay-us, --delay-up-us,
// --delay-down-us: [0, kMaxDelayUs]), but not both for one direction. On a bad argument
// returns false with `error` naming the flag(s) (without a program prefix).
bool ParseFlags(const std::vector<std::string>& args, Flags* flags, std::string* error);

}  // namespace hsbn::linkproxy

#endif  // HSBN_TOOLS_LINKPROXY_LINKPROXY_H_
