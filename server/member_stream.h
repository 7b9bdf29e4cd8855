// server/member_stream.h — the protocol policy of one member-facing Exchange stream, without
// gRPC.
//
// A MemberStream decides what each ClientFrame read from a member's stream may do: an Attach
// binds sessions (through Registry::Authorize, with the job's token when tokens are on) to this
// stream's sink; a Contribution reaches its job only on a session bound here; NodeState and
// Leave frames are taken only from an aggregator's session (a sidecar below a root); an Abort
// from an aggregator fails one round, from a worker it says that worker is gone and why (only
// in the job of a session bound here: it can fail no other job's rounds); a
// stream may send at most max_unbound_bytes before its first successful Attach. The gRPC call
// object (ExchangeCall in aggregator.cc) drives it with every message it reads, and
// tests/fuzz/fuzz_frames.cc drives the same class, so the fuzzer tests the real dispatch.
//
// Thread safety: not thread-safe; one stream's frames are handled one at a time (the
// aggregator's event thread).
#ifndef HSBN_SERVER_MEMBER_STREAM_H_
#define HSBN_SERVER_MEMBER_STREAM_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "hsbn/v1/hsbn.pb.h"
#include "job.h"
#include "registry.h"
#include "session.h"

namespace hsbn::server {

// Where a stream's results go: a ResultSink that can also be told to batch them.
class MemberSink : public ResultSink {
 public:
  virtual void EnableBatches() = 0;
};

// What the stream's owner does for it: the aggregator, or a test's model of one.
class MemberStreamHost {
 public:
  virtual ~MemberStreamHost() = default;
  virtual Registry& registry() = 0;
  virtual Clock::time_point Now() { return Clock::now(); }
  // Performs what `job` asked for (results, forwards, aborts), outside the job's lock.
  virtual void Execute(const std::shared_ptr<Job>& job, Actions& actions) = 0;
  // A frame that was ignored, and why (rate-limited by the aggregator).
  virtual void LogInvalid(const std::string& what) = 0;
  // A refusal for the metrics (e.g. "unbound_bytes").
  virtual void Refused(const char* reason) = 0;
  // An aggregator member left `session`'s job (its Leave frame).
  virtual void Leave(const SessionId& session) = 0;
  // A worker of `job_id` waits for round `key`'s late result (its LateWanted frame).
  virtual void LateWanted(const std::string& /*job_id*/, const RoundKey& /*key*/) {}
  // A worker aborted (its Abort frame): like its stream breaking, with its reason.
  virtual void Aborted(const Registry::SessionRef& ref, const SessionId& session,
                       const std::string& reason) {}
  // Observers, for tests that model the protocol: a session was bound to this stream; a
  // contribution on a bound session was accepted (Job::Contribute returned true).
  virtual void Attached(const Registry::SessionRef&, const SessionId&) {}
  virtual void Contributed(const Registry::SessionRef&, const SessionId&,
                           const v1::Contribution&) {}
};

class MemberStream {
 public:
  MemberStream(MemberStreamHost* host, std::shared_ptr<MemberSink> sink, int64_t max_unbound_bytes)
      : host_(host), sink_(std::move(sink)), max_unbound_bytes_(max_unbound_bytes) {}

  // Handles one message read from the stream: a frame, or a batch of frames. OK: read on.
  // Otherwise the stream must end with this status and read nothing more (RESOURCE_EXHAUSTED:
  // too many bytes before an Attach).
  absl::Status Read(const v1::ClientFrame& message);

  // Every session ever bound here, for the host to report gone when the stream breaks.
  const std::vector<SessionId>& sessions() const { return sessions_; }

 private:
  void Handle(const v1::ClientFrame& frame);
  void Bind(const std::string& bytes, const std::string& token);
  // The session of a frame, if an Attach bound it to this stream.
  const Registry::SessionRef* Bound(const std::string& bytes, SessionId* session) const;
  void SendError(const v1::Contribution& c, const absl::Status& status);
  void HandleContribution(const v1::Contribution& c);
  // A frame only aggregators send (Abort, NodeState, Leave): its session's ref, or nullptr
  // (logged) when the session is not bound here or is a worker's.
  const Registry::SessionRef* FromAggregator(const std::string& bytes, const char* what,
                                             SessionId* session);
  void HandleAbort(const v1::Abort& a);
  void HandleNodeState(const v1::NodeState& state);
  void HandleLeave(const v1::LeaveRequest& leave);
  // Any member's, on a session bound here.
  void HandleLayerNames(const v1::LayerNames& names);
  void HandleLaggedTrip(const v1::LaggedTrip& trip);
  void HandleLateWanted(const v1::LateWanted& wanted);
  void Unbind(const SessionId& session);

  MemberStreamHost* const host_;
  const std::shared_ptr<MemberSink> sink_;
  const int64_t max_unbound_bytes_;
  std::vector<SessionId> sessions_;
  std::vector<std::pair<SessionId, Registry::SessionRef>> bound_;
  int64_t unbound_bytes_ = 0;
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_MEMBER_STREAM_H_
