// grpc_star — the floor of hsbn's transport: a callback-API gRPC server with one bidirectional
// stream per worker, carrying raw bytes, that per round sums the --workers contributions and
// writes the sum back on every stream. With one worker it is a bare gRPC ping-pong. It has what
// an aggregator cannot avoid (gRPC framing, HTTP/2, the callback executor, one copy into the
// message) and nothing else: no validation, no round keys, no membership.
//
//   grpc_star --role=server --listen=unix:PATH|HOST:PORT --workers=N --ready-file=F
//             [--async] [--stats-file=F]
//   grpc_star --role=worker --connect=ADDR --rank=R [--reader-thread] <plan flags>
//
// --async serves the same streams with gRPC's async (completion-queue) API instead: one
// ServerCompletionQueue drained by the main thread alone, which handles every event inline. No
// callback API is touched in that process, so gRPC starts none of the callback executor's
// threads (CallbackAlternativeCQ's "nexting" pollers); measured beside the callback server it
// prices those threads' hand-offs. Same round logic, flags, ready file and exit: the server
// returns once --workers streams have ended.
//
// --stats-file: when --workers streams have ended, the server (either kind) writes one line
//   server <rounds> <wall ns> <user ns> <sys ns> <vol csw> <invol csw> <main user ns>
//          <main sys ns> <main vol csw> <main invol csw> <threads>
// measured from its first accepted stream to its last ended one: rounds it answered, the
// process's CPU and context switches (getrusage RUSAGE_SELF: all threads, ended ones included),
// the main thread's alone (RUSAGE_THREAD; in --async mode the thread that does all the work)
// and the number of threads the process has at the end. run.py reads it because the server has
// exited (its /proc counters gone with its threads) by the time the driver looks.
//
// --reader-thread gives the worker the shape of hsbn's client today: the caller writes, a
// dedicated thread blocks in Read and hands each answer to the caller through a condition
// variable. Measured beside the plain worker, it prices that thread hop alone.
#include <grpcpp/grpcpp.h>

#include <dirent.h>
#include <sys/resource.h>

#include <thread>

#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "bench_common.h"
#include "pingpong.grpc.pb.h"

namespace hsbn_bench {
namespace {

using hsbn::bench::Blob;
using hsbn::bench::PingPong;

// Counters of the process and of the calling thread, for --stats-file.
struct Usage {
  int64_t wall_ns = 0;
  rusage self{}, thread{};
  static Usage Now() {
    Usage u;
    u.wall_ns = NowNs();
    getrusage(RUSAGE_SELF, &u.self);
    getrusage(RUSAGE_THREAD, &u.thread);
    return u;
  }
};

int CountThreads() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

// Writes the --stats-file line (see the header) for the window [a, b].
void WriteStats(const Args& args, uint64_t rounds, const Usage& a, const Usage& b) {
  if (!args.Has("stats-file")) return;
  auto ns = [](const timeval& tv) {
    return static_cast<long long>(tv.tv_sec) * 1000000000LL + tv.tv_usec * 1000LL;
  };
  std::string tmp = args.Str("stats-file") + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) return;
  std::fprintf(f, "server %llu %lld %lld %lld %ld %ld %lld %lld %ld %ld %d\n",
               static_cast<unsigned long long>(rounds),
               static_cast<long long>(b.wall_ns - a.wall_ns),
               ns(b.self.ru_utime) - ns(a.self.ru_utime), ns(b.self.ru_stime) - ns(a.self.ru_stime),
               b.self.ru_nvcsw - a.self.ru_nvcsw, b.self.ru_nivcsw - a.self.ru_nivcsw,
               ns(b.thread.ru_utime) - ns(a.thread.ru_utime),
               ns(b.thread.ru_stime) - ns(a.thread.ru_stime),
               b.thread.ru_nvcsw - a.thread.ru_nvcsw, b.thread.ru_nivcsw - a.thread.ru_nivcsw,
               CountThreads());
  std::fclose(f);
  std::rename(tmp.c_str(), args.Str("stats-file").c_str());
}

// One round's sum over the workers' frames (raw doubles), shared by both servers: Add returns
// true when the round is complete, with its bytes in result(); the next Add starts a new round.
class RoundSum {
 public:
  explicit RoundSum(int workers) : workers_(workers) {}
  bool Add(const std::string& data) {
    const size_t n = data.size() / sizeof(double);
    if (arrived_ == 0) acc_.assign(n, 0.0);
    if (acc_.size() != n) Die("frame size mismatch");
    x_.resize(n);
    std::memcpy(x_.data(), data.data(), data.size());
    SumInto(acc_.data(), x_.data(), n);
    if (++arrived_ < workers_) return false;
    result_.assign(reinterpret_cast<const char*>(acc_.data()), acc_.size() * sizeof(double));
    arrived_ = 0;
    ++rounds_;
    return true;
  }
  const std::string& result() const { return result_; }
  uint64_t rounds() const { return rounds_; }

 private:
  const int workers_;
  std::vector<double> acc_, x_;
  std::string result_;
  int arrived_ = 0;
  uint64_t rounds_ = 0;
};

class Star;

// One worker's stream. Reads are re-armed at once (a worker has at most one round in flight);
// a reply that arrives while the previous write is still completing waits in `pending_`.
class Stream final : public grpc::ServerBidiReactor<Blob, Blob> {
 public:
  explicit Stream(Star* star) : star_(star) { StartRead(&in_); }
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      writing_ = false;
      if (!has_pending_) return;
      has_pending_ = false;
      out_.set_data(std::move(pending_));
      writing_ = true;
    }
    StartWrite(&out_);
  }
  void OnDone() override;
  void Reply(const std::string& data) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (writing_) {
        pending_ = data;
        has_pending_ = true;
        return;
      }
      out_.set_data(data);
      writing_ = true;
    }
    StartWrite(&out_);
  }

 private:
  Star* star_;
  Blob in_, out_;
  std::mutex mu_;
  bool writing_ = false;
  bool has_pending_ = false;
  std::string pending_;
};

class Star {
 public:
  explicit Star(int workers) : workers_(workers), sum_(workers) {}

  void Contribute(Stream* s, const std::string& data) {
    std::vector<Stream*> members;
    std::string result;
    {
      std::lock_guard<std::mutex> lock(mu_);
      members_.push_back(s);
      if (!sum_.Add(data)) return;
      result = sum_.result();
      members.swap(members_);
    }
    for (Stream* m : members) m->Reply(result);
  }

  void StreamStarted() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_) started_ = true, start_ = Usage::Now();
  }
  void StreamDone() {
    std::lock_guard<std::mutex> lock(mu_);
    ++done_;
    cv_.notify_all();
  }
  // Returns the counters at the first stream's start and the rounds answered.
  std::pair<Usage, uint64_t> WaitAllDone() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_ >= workers_; });
    return {start_, sum_.rounds()};
  }

 private:
  const int workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  RoundSum sum_;
  std::vector<Stream*> members_;
  int done_ = 0;
  bool started_ = false;
  Usage start_;
};

void Stream::OnReadDone(bool ok) {
  if (!ok) {
    Finish(grpc::Status::OK);
    return;
  }
  star_->Contribute(this, in_.data());
  StartRead(&in_);
}

void Stream::OnDone() {
  star_->StreamDone();
  delete this;
}

class Service final : public PingPong::CallbackService {
 public:
  explicit Service(Star* star) : star_(star) {}
  grpc::ServerBidiReactor<Blob, Blob>* Exchange(grpc::CallbackServerContext*) override {
    star_->StreamStarted();
    return new Stream(star_);
  }

 private:
  Star* star_;
};

// Adds the listening port; after BuildAndStart, Announce writes the bound address to --ready-file.
std::string Listen(const Args& args, grpc::ServerBuilder* builder, int* port) {
  std::string listen = args.Str("listen", "unix:/tmp/hsbn-bench-grpc.sock");
  builder->AddListeningPort(listen, grpc::InsecureServerCredentials(), port);
  return listen;
}

void Announce(const Args& args, const std::string& listen, int port) {
  std::string bound = listen;
  if (listen.rfind("unix:", 0) != 0) {
    bound = listen.substr(0, listen.rfind(':')) + ":" + std::to_string(port);
  }
  if (args.Has("ready-file")) {
    std::string tmp = args.Str("ready-file") + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "w");
    std::fprintf(f, "%s\n", bound.c_str());
    std::fclose(f);
    std::rename(tmp.c_str(), args.Str("ready-file").c_str());
  }
}

int Server(const Args& args) {
  const int n = static_cast<int>(args.Int("workers", 1));
  Star star(n);
  Service service(&star);
  int port = 0;
  grpc::ServerBuilder builder;
  std::string listen = Listen(args, &builder, &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) Die("cannot listen on " + listen);
  Announce(args, listen, port);
  const Usage main0 = Usage::Now();  // the main thread only waits: its counters from here
  std::pair<Usage, uint64_t> start = star.WaitAllDone();
  start.first.thread = main0.thread;
  WriteStats(args, start.second, start.first, Usage::Now());
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  return 0;
}

// ---- --async: the completion-queue API, one thread ----------------------------------------
//
// Every operation started on a stream names one of its tags; the main thread takes each
// completion from the queue and calls the tag's stream, which may start the next operations.
// Per stream at most one read (re-armed after each one) and one write are in flight; a reply
// produced while a write is in flight waits in `pending_` and goes out when it completes.

class AsyncStream;

struct Tag {
  enum Kind { kAccept, kRead, kWrite, kFinish };
  AsyncStream* stream;
  Kind kind;
};

class AsyncStar {
 public:
  explicit AsyncStar(int workers) : workers_(workers), sum_(workers) {}
  void Contribute(AsyncStream* s, const std::string& data);
  void StreamStarted() {
    if (!started_) started_ = true, start_ = Usage::Now();
  }
  void StreamDone() { ++done_; }
  bool AllDone() const { return done_ >= workers_; }
  uint64_t rounds() const { return sum_.rounds(); }
  const Usage& start() const { return start_; }

 private:
  const int workers_;
  RoundSum sum_;
  std::vector<AsyncStream*> members_;
  int done_ = 0;
  bool started_ = false;
  Usage start_;
};

class AsyncStream {
 public:
  // Asks the server for the next incoming stream; the object lives until that stream ends
  // (or, for the last request, until the server shuts down and fails it).
  AsyncStream(PingPong::AsyncService* service, grpc::ServerCompletionQueue* cq, AsyncStar* star)
      : service_(service), cq_(cq), star_(star), rw_(&ctx_) {
    service_->RequestExchange(&ctx_, &rw_, cq_, cq_, &accept_);
  }

  // One completion of this stream's operation `kind`. May delete the stream.
  void Proceed(Tag::Kind kind, bool ok) {
    switch (kind) {
      case Tag::kAccept:
        if (!ok) {  // the server is shutting down: no stream came
          delete this;
          return;
        }
        star_->StreamStarted();
        new AsyncStream(service_, cq_, star_);  // keep one request armed for the next worker
        rw_.Read(&in_, &read_);
        return;
      case Tag::kRead:
        if (!ok) {  // the worker closed its side (WritesDone) or the stream broke
          read_closed_ = true;
          MaybeFinish();
          return;
        }
        star_->Contribute(this, in_.data());
        rw_.Read(&in_, &read_);
        return;
      case Tag::kWrite:
        writing_ = false;
        if (!ok) broken_ = true, has_pending_ = false;  // the stream is gone; so is the reply
        if (has_pending_) {
          has_pending_ = false;
          out_.set_data(std::move(pending_));
          StartWrite();
          return;
        }
        MaybeFinish();
        return;
      case Tag::kFinish:
        star_->StreamDone();
        delete this;
        return;
    }
  }

  void Reply(const std::string& data) {
    if (finishing_ || broken_) return;
    if (writing_) {
      pending_ = data;
      has_pending_ = true;
      return;
    }
    out_.set_data(data);
    StartWrite();
  }

 private:
  void StartWrite() {
    writing_ = true;
    rw_.Write(out_, &write_);
  }
  // Finishes once the worker's side is closed and no write is in flight or waiting.
  void MaybeFinish() {
    if (!read_closed_ || writing_ || has_pending_ || finishing_) return;
    finishing_ = true;
    rw_.Finish(grpc::Status::OK, &finish_);
  }

  PingPong::AsyncService* service_;
  grpc::ServerCompletionQueue* cq_;
  AsyncStar* star_;
  grpc::ServerContext ctx_;
  grpc::ServerAsyncReaderWriter<Blob, Blob> rw_;
  Tag accept_{this, Tag::kAccept}, read_{this, Tag::kRead}, write_{this, Tag::kWrite},
      finish_{this, Tag::kFinish};
  Blob in_, out_;
  bool writing_ = false, has_pending_ = false, read_closed_ = false, finishing_ = false,
       broken_ = false;
  std::string pending_;
};

void AsyncStar::Contribute(AsyncStream* s, const std::string& data) {
  members_.push_back(s);
  if (!sum_.Add(data)) return;
  for (AsyncStream* m : members_) m->Reply(sum_.result());
  members_.clear();
}

int AsyncServer(const Args& args) {
  const int n = static_cast<int>(args.Int("workers", 1));
  AsyncStar star(n);
  PingPong::AsyncService service;
  int port = 0;
  grpc::ServerBuilder builder;
  std::string listen = Listen(args, &builder, &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::ServerCompletionQueue> cq = builder.AddCompletionQueue();
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) Die("cannot listen on " + listen);
  new AsyncStream(&service, cq.get(), &star);
  Announce(args, listen, port);
  void* tag;
  bool ok;
  while (!star.AllDone() && cq->Next(&tag, &ok)) {
    Tag* t = static_cast<Tag*>(tag);
    t->stream->Proceed(t->kind, ok);
  }
  WriteStats(args, star.rounds(), star.start(), Usage::Now());
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  cq->Shutdown();
  while (cq->Next(&tag, &ok)) {  // the armed request (and any stream left) fails: free them
    Tag* t = static_cast<Tag*>(tag);
    t->stream->Proceed(t->kind, ok);
  }
  return 0;
}

int Worker(const Args& args) {
  const int rank = static_cast<int>(args.Int("rank", 0));
  Plan plan = Plan::FromArgs(args);
  auto channel = grpc::CreateChannel(args.Str("connect"), grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(20))) {
    Die("cannot connect to " + args.Str("connect"));
  }
  auto stub = PingPong::NewStub(channel);
  grpc::ClientContext ctx;
  auto stream = stub->Exchange(&ctx);
  Blob msg, reply;
  if (args.Has("reader-thread")) {
    std::mutex mu;
    std::condition_variable cv;
    bool ready = false, broken = false;
    std::thread reader([&] {
      Blob r;
      while (stream->Read(&r)) {
        std::lock_guard<std::mutex> lock(mu);
        reply.Swap(&r);
        ready = true;
        cv.notify_all();
      }
      std::lock_guard<std::mutex> lock(mu);
      broken = true;
      cv.notify_all();
    });
    RunPlan(plan, rank, [&](int channels, Phase, Scope, const double* in, double* out, uint32_t,
                            uint64_t) {
      const size_t len = (2 * channels + 1) * sizeof(double);
      msg.set_data(reinterpret_cast<const char*>(in), len);
      if (!stream->Write(msg)) Die("stream broke");
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return ready || broken; });
      if (!ready || reply.data().size() != len) Die("stream broke");
      ready = false;
      std::memcpy(out, reply.data().data(), len);
    });
    stream->WritesDone();
    reader.join();
    return stream->Finish().ok() ? 0 : 1;
  }
  RunPlan(plan, rank, [&](int channels, Phase, Scope, const double* in, double* out, uint32_t,
                          uint64_t) {
    const size_t len = (2 * channels + 1) * sizeof(double);
    msg.set_data(reinterpret_cast<const char*>(in), len);
    if (!stream->Write(msg) || !stream->Read(&reply) || reply.data().size() != len) {
      Die("stream broke");
    }
    std::memcpy(out, reply.data().data(), len);
  });
  stream->WritesDone();
  grpc::Status st = stream->Finish();
  return st.ok() ? 0 : 1;
}

}  // namespace
}  // namespace hsbn_bench

int main(int argc, char** argv) {
  hsbn_bench::Args args(argc, argv);
  if (args.Str("role") != "server") return hsbn_bench::Worker(args);
  return args.Has("async") ? hsbn_bench::AsyncServer(args) : hsbn_bench::Server(args);
}
