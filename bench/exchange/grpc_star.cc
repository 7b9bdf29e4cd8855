// grpc_star — the floor of hsbn's transport: a callback-API gRPC server with one bidirectional
// stream per worker, carrying raw bytes, that per round sums the --workers contributions and
// writes the sum back on every stream. With one worker it is a bare gRPC ping-pong. It has what
// an aggregator cannot avoid (gRPC framing, HTTP/2, the callback executor, one copy into the
// message) and nothing else: no validation, no round keys, no membership.
//
//   grpc_star --role=server --listen=unix:PATH|HOST:PORT --workers=N --ready-file=F
//   grpc_star --role=worker --connect=ADDR --rank=R [--reader-thread] <plan flags>
//
// --reader-thread gives the worker the shape of hsbn's client today: the caller writes, a
// dedicated thread blocks in Read and hands each answer to the caller through a condition
// variable. Measured beside the plain worker, it prices that thread hop alone.
#include <grpcpp/grpcpp.h>

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
  explicit Star(int workers) : workers_(workers) {}

  void Contribute(Stream* s, const std::string& data) {
    std::vector<Stream*> members;
    std::string result;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const size_t n = data.size() / sizeof(double);
      if (arrived_ == 0) acc_.assign(n, 0.0);
      if (acc_.size() != n) Die("frame size mismatch");
      x_.resize(n);
      std::memcpy(x_.data(), data.data(), data.size());
      SumInto(acc_.data(), x_.data(), n);
      members_.push_back(s);
      if (++arrived_ < workers_) return;
      result.assign(reinterpret_cast<const char*>(acc_.data()), acc_.size() * sizeof(double));
      members.swap(members_);
      arrived_ = 0;
    }
    for (Stream* m : members) m->Reply(result);
  }

  void StreamDone() {
    std::lock_guard<std::mutex> lock(mu_);
    ++done_;
    cv_.notify_all();
  }
  void WaitAllDone() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_ >= workers_; });
  }

 private:
  const int workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<double> acc_, x_;
  std::vector<Stream*> members_;
  int arrived_ = 0;
  int done_ = 0;
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
    return new Stream(star_);
  }

 private:
  Star* star_;
};

int Server(const Args& args) {
  const int n = static_cast<int>(args.Int("workers", 1));
  Star star(n);
  Service service(&star);
  std::string listen = args.Str("listen", "unix:/tmp/hsbn-bench-grpc.sock");
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) Die("cannot listen on " + listen);
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
  star.WaitAllDone();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
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
  return args.Str("role") == "server" ? hsbn_bench::Server(args) : hsbn_bench::Worker(args);
}
