// server/transport.h — the one seam between the aggregator and the ways a node's rounds travel.
//
// The Aggregator owns the job lifecycle (Registry, Job) and tells every transport of it through
// this interface, in a fixed order (the order of Aggregator::transports_), naming none of them:
// a process joined, was refused or left, a member's stream broke or it aborted, the parent
// answered or was lost, a job was dropped or replaced, the process shuts down. Two implement it:
// the member streams (stream_transport.h: gRPC Exchange streams, every role) and the sidecar's
// shared-memory node path (shm_transport.h). A transport that has nothing to do for an event
// does nothing; the defaults below are exactly that.
//
// Thread safety: every method may be called from any thread, concurrently.
#ifndef HSBN_SERVER_TRANSPORT_H_
#define HSBN_SERVER_TRANSPORT_H_

#include <chrono>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "hsbn/v1/hsbn.pb.h"
#include "job.h"

namespace hsbn::server {

// What a transport asks of the aggregator.
class TransportHost {
 public:
  virtual ~TransportHost() = default;
  // Runs what an event of the transport calls for, as for the Job's own calls: partials and
  // failed rounds for the parent (in that order), results, log lines, metrics.
  virtual void Execute(Actions& actions, const std::string& job_id) = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // The process shuts down: open rounds fail with `closing` (its message, its reason) and the
  // transport stops. Called once, after the Registry admits nothing any more.
  virtual void Shutdown(const absl::Status& closing) = 0;

  // Before a Join is admitted: a non-OK status refuses it (the caller answers it as is).
  virtual absl::Status CheckJoin(const v1::JoinRequest&) { return absl::OkStatus(); }
  // After a Join was admitted as member `index`: fills what the response says of this
  // transport. The first transport that describes the node (Describe) fills the note.
  virtual void Joined(const v1::JoinRequest&, int32_t /*index*/, v1::JoinResponse*) {}
  // A process was refused joining `job_id` for its layout: the job's rounds fail with `refusal`.
  virtual void Refused(const std::string& /*job_id*/, const absl::Status& /*refusal*/) {}
  // Member `index` of `job_id` left (left=true) or its stream broke; `aborted` non-empty: it
  // aborted, and why.
  virtual void MemberGone(const std::string& /*job_id*/, int32_t /*index*/, bool /*left*/,
                          const std::string& /*aborted*/) {}
  // The Registry dropped the job, or replaced it by a new run: its open rounds fail with `why`.
  virtual void JobDropped(const std::string& /*job_id*/, const std::string& /*why*/) {}
  // The parent's answer to a round: true if this transport forwarded it and has now delivered
  // it (then no other transport sees it).
  virtual bool ParentResult(const std::string& /*job_id*/, const v1::Result&) { return false; }
  // The link to the parent broke: every round this transport forwarded fails with `status`.
  virtual void ParentLost(const absl::Status& /*status*/) {}

  // How the node's rounds of `job_id` travel, for Status and the Join response ("shm",
  // "grpc: <why>", "pending"); "" where this transport has nothing to say (the next one is asked).
  virtual std::string Describe(const std::string& /*job_id*/) const { return ""; }
  // Adds the rounds this transport answered for the job to its Status counters.
  virtual void AddCounts(const std::string& /*job_id*/, v1::JobStatus*) const {}
  // Every tick of the aggregator's deadline thread (--tick, about 100 ms apart here): checks
  // what the transport watches by time.
  virtual void Tick(std::chrono::steady_clock::time_point /*now*/) {}
  // Moves what the transport counted since the last call into the process's metrics (before a
  // scrape, so that it sees every round a worker was answered).
  virtual void HarvestMetrics() {}
};

}  // namespace hsbn::server

#endif  // HSBN_SERVER_TRANSPORT_H_
