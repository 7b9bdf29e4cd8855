// tests/fuzz/fuzz_frames.cc — what an aggregator does with the bytes clients send it.
//
// A Registry (server/registry.h) in the node role (with or without a root above), the group
// role (sidecars join it; with or without a root above) or the root role, with or without tokens, a small memory budget and few jobs, fed a sequence of:
//   - Join requests, parsed from raw bytes or built from arbitrary fields;
//   - ClientFrames on one of three streams, parsed from raw bytes (batches included) or built,
//     each handed to that stream's server::MemberStream (member_stream.h), the policy the
//     aggregator's gRPC call drives: an Attach binds sessions through Registry::Authorize and
//     Job::Attach; a Contribution reaches Job::Contribute only on a session its stream bound;
//     Abort, NodeState and Leave frames only from an aggregator's session; a LateWanted reaches
//     the aggregator only for a job its stream bound a session to, with a phase; at most
//     kMaxUnboundBytes before the first Attach;
//   - streams that break (every session they bound is reported gone), Leaves, Status requests;
//   - upstream ServerFrames (a result or a batch, raw or built) handed to Job::ParentResult, a
//     lost upstream link, and time passing (Registry::Sweep, Job::Expire);
//   - token files parsed by TokenStore::Parse.
// Sessions are the aggregator's random secrets, which no input can guess: a session field of
// exactly one byte stands for the n-th session the Registry handed out, one of two bytes for
// that session with a bit flipped (a forgery); any other length is sent as it is.
//
// Checked on every input: the invariants of tests/fuzz/invariants.h for every job; the bytes
// held by all live jobs equal the budget's use after every step; zero once the streams and the
// Registry are gone.
#include <fuzzer/FuzzedDataProvider.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "google/protobuf/stubs/logging.h"
#include "invariants.h"
#include "log.h"
#include "member_stream.h"
#include "registry.h"
#include "tokens.h"
#include "wire.h"

namespace {

using hsbn::fuzz::RoundLedger;
using hsbn::fuzz::StreamSink;
using namespace hsbn::server;
namespace v1 = hsbn::v1;

// Every scope value a client can send: the five the wire knows, the reserved 5 (auto, never on
// the wire), renorm and lagged (late results, kept lagged forward records) and one unknown.
v1::Scope AnyScope(FuzzedDataProvider& in) {
  return v1::Scope(in.ConsumeIntegralInRange<int>(0, 8));
}

constexpr int64_t kMaxUnboundBytes = 4096;
constexpr int kStreams = 3;

std::shared_ptr<TokenStore> Tokens() {
  static std::shared_ptr<TokenStore> store = [] {
    char path[] = "/tmp/hsbn-fuzz-tokens-XXXXXX";
    const int fd = mkstemp(path);
    const std::string text = "a secret-a\n* secret-any\n";
    if (fd < 0 || write(fd, text.data(), text.size()) != ssize_t(text.size())) std::abort();
    close(fd);
    auto s = TokenStore::Load(path, /*allow_insecure=*/true);
    unlink(path);
    if (!s.ok()) std::abort();
    return *s;
  }();
  return store;
}

struct Member {  // what the harness knows of one member of one job
  RoundLedger::MemberModel model;
};

struct JobWatch {  // one Job object (a job id may get a new one after a sweep)
  std::weak_ptr<Job> job;
  std::unique_ptr<RoundLedger> ledger;
  std::vector<RoundLedger::MemberModel> model;
};

struct Stream {
  std::shared_ptr<StreamSink> sink;
  std::unique_ptr<MemberStream> policy;
  bool closed = false;
};

struct Harness final : MemberStreamHost {
  std::unique_ptr<Registry> registry_;
  std::shared_ptr<MemoryBudget> budget;
  Stream* reading = nullptr;  // the stream whose frame is being handled
  bool root = false;
  bool has_parent = false;
  Stream streams[kStreams];
  std::vector<SessionId> issued;              // every session the Registry handed out
  std::map<const Job*, JobWatch> watched;     // every Job ever created
  Clock::time_point now = Clock::now();

  JobWatch& Watch(const std::shared_ptr<Job>& job) {
    auto it = watched.find(job.get());
    if (it != watched.end() && it->second.job.lock() == job) return it->second;
    JobWatch& w = watched[job.get()];
    w.job = job;
    w.ledger = std::make_unique<RoundLedger>(job->layout().expected_members(),
                                             /*keeps_all=*/false);
    w.model.assign(job->layout().expected_members(), {});
    return w;
  }

  void Check(const std::shared_ptr<Job>& job, const Actions& a) {
    if (job) {
      JobWatch& w = Watch(job);
      w.ledger->Check(a, w.model);
    }
    int64_t held = 0;
    for (auto it = watched.begin(); it != watched.end();) {
      if (auto j = it->second.job.lock()) {
        held += j->held_bytes();
        ++it;
      } else {
        it = watched.erase(it);
      }
    }
    HSBN_FUZZ_CHECK(held == budget->used(), "live jobs hold " + std::to_string(held) +
                                                " bytes but the budget counts " +
                                                std::to_string(budget->used()));
  }

  std::string SessionField(const std::string& raw) const {
    if (issued.empty() || (raw.size() != 1 && raw.size() != 2)) return raw;
    std::string s = issued[uint8_t(raw[0]) % issued.size()].Bytes();
    if (raw.size() == 2) s[uint8_t(raw[1]) % 16] ^= char(1 << (uint8_t(raw[1]) >> 5));
    return s;
  }

  std::string SessionFrom(FuzzedDataProvider& in) {
    const int kind = in.ConsumeIntegralInRange<int>(0, 7);
    if (kind < 5) return SessionField(std::string(1, char(in.ConsumeIntegral<uint8_t>())));
    if (kind == 5) return SessionField(in.ConsumeBytesAsString(2));
    return in.ConsumeRandomLengthString(20);
  }

  // Session fields in a parsed frame are rewritten as described at the top.
  void Resolve(v1::ClientFrame* f) {
    switch (f->frame_case()) {
      case v1::ClientFrame::kAttach:
        for (std::string& s : *f->mutable_attach()->mutable_sessions()) s = SessionField(s);
        break;
      case v1::ClientFrame::kContribution:
        f->mutable_contribution()->set_session(SessionField(f->contribution().session()));
        break;
      case v1::ClientFrame::kAbort:
        f->mutable_abort()->set_session(SessionField(f->abort().session()));
        break;
      case v1::ClientFrame::kNodeState:
        f->mutable_node_state()->set_session(SessionField(f->node_state().session()));
        break;
      case v1::ClientFrame::kLeave:
        f->mutable_leave()->set_session(SessionField(f->leave().session()));
        break;
      case v1::ClientFrame::kLateWanted:
        f->mutable_late_wanted()->set_session(SessionField(f->late_wanted().session()));
        break;
      case v1::ClientFrame::kBatch:
        for (v1::ClientFrame& g : *f->mutable_batch()->mutable_frames()) Resolve(&g);
        break;
      default:
        break;
    }
  }

  // ---- Join, Leave, Status (the unary calls) ----

  v1::JoinRequest MakeJoin(FuzzedDataProvider& in) {
    v1::JoinRequest r;
    if (in.ConsumeProbability<float>() < 0.2f) {
      (void)r.ParseFromString(in.ConsumeRandomLengthString(200));
      return r;
    }
    r.set_protocol_version(in.ConsumeProbability<float>() < 0.95f
                               ? int(v1::PROTOCOL_VERSION_2)
                               : in.ConsumeIntegral<int32_t>());
    static const char* kJobs[] = {"a", "b", "c", "job with space", ""};
    const int j = in.ConsumeIntegralInRange<int>(0, 5);
    r.set_job_id(j < 5 ? kJobs[j] : in.ConsumeRandomLengthString(300));
    r.set_kind(in.ConsumeProbability<float>() < 0.9f
                   ? (root ? v1::MEMBER_KIND_AGGREGATOR : v1::MEMBER_KIND_WORKER)
                   : v1::MemberKind(in.ConsumeIntegralInRange<int>(0, 3)));
    const int lws = in.ConsumeIntegralInRange<int>(1, 3);
    const int nodes = in.ConsumeIntegralInRange<int>(1, 3);
    const int node = in.ConsumeIntegralInRange<int>(0, nodes - 1);
    const int local = in.ConsumeIntegralInRange<int>(0, lws - 1);
    r.set_world_size(lws * nodes);
    r.set_local_world_size(lws);
    r.set_node_rank(node);
    r.set_local_rank(local);
    r.set_rank(node * lws + local);
    switch (in.ConsumeIntegralInRange<int>(0, 9)) {  // one field wrong, now and then
      case 0: r.set_world_size(in.ConsumeIntegral<int32_t>()); break;
      case 1: r.set_local_world_size(in.ConsumeIntegral<int32_t>()); break;
      case 2: r.set_node_rank(in.ConsumeIntegral<int32_t>()); break;
      case 3: r.set_rank(in.ConsumeIntegral<int32_t>()); break;
      case 4: r.set_local_rank(in.ConsumeIntegral<int32_t>()); break;
      default: break;
    }
    if (in.ConsumeBool()) r.set_previous_session(SessionFrom(in));
    const int t = in.ConsumeIntegralInRange<int>(0, 3);
    if (t == 1) r.set_token("secret-a");
    if (t == 2) r.set_token("secret-any");
    if (t == 3) r.set_token(in.ConsumeRandomLengthString(16));
    r.set_strict_finite(in.ConsumeProbability<float>() < 0.2f);
    // Groups, and what an aggregator member covers (a group aggregator: K nodes).
    if (in.ConsumeBool()) r.set_group_nodes(in.ConsumeIntegralInRange<int>(0, nodes));
    if (in.ConsumeBool()) {
      r.set_member_nodes(in.ConsumeBool() ? r.group_nodes() : in.ConsumeIntegralInRange<int>(-1, 4));
      if (r.member_nodes() > 1) r.set_node_rank(node - node % r.member_nodes());
    }
    return r;
  }

  void Join(FuzzedDataProvider& in) {
    Actions a;
    absl::StatusOr<Registry::Joined> joined = registry_->Join(MakeJoin(in), &a);
    if (!joined.ok()) {
      const v1::Reason why = hsbn::wire::ReasonOf(joined.status());
      if (why == v1::REASON_LAYOUT || why == v1::REASON_GROUP_NODES) {
        // A layout refusal reaches every member of the job (docs/PROTOCOL.md): it may fail
        // the job's rounds, here and at the parent, and do nothing else.
        HSBN_FUZZ_CHECK(a.forwards.empty() && a.node_states.empty() && a.names.empty(),
                        "a refused Join forwarded a partial or a node state");
        for (const auto& d : a.deliveries) {
          HSBN_FUZZ_CHECK(d.result->code() != 0, "a refused Join delivered a result");
        }
      } else {
        HSBN_FUZZ_CHECK(a.empty(), "a refused Join changed a job");
      }
      return;
    }
    JobWatch& w = Watch(joined->job);
    HSBN_FUZZ_CHECK(joined->index >= 0 && joined->index < int(w.model.size()),
                    "Join admitted member " + std::to_string(joined->index) + " of " +
                        std::to_string(w.model.size()));
    w.model[joined->index] = {joined->session, false};
    issued.push_back(joined->session);
    Check(joined->job, a);
  }

  void Leave(FuzzedDataProvider& in) {
    SessionId session;
    if (SessionId::FromBytes(SessionFrom(in), &session)) Leave(session);
  }

  void Status(FuzzedDataProvider& in) {
    v1::StatusRequest req;
    req.set_job_id(in.ConsumeBool() ? "a" : in.ConsumeRandomLengthString(8));
    req.set_token(in.ConsumeBool() ? "secret-a" : in.ConsumeRandomLengthString(12));
    auto jobs = registry_->StatusJobs(req);
    if (!jobs.ok()) return;
    for (const auto& job : *jobs) {
      if (registry_->tokens_on()) {
        HSBN_FUZZ_CHECK(job->id() == req.job_id(), "Status with tokens showed another job");
      }
      v1::JobStatus s;
      job->FillStatus(&s);
    }
  }

  // ---- the Exchange stream (ExchangeCall in server/aggregator.cc) ----

  v1::ClientFrame MakeFrame(FuzzedDataProvider& in, int depth = 0) {
    v1::ClientFrame f;
    switch (in.ConsumeIntegralInRange<int>(0, depth == 0 ? 5 : 4)) {
      case 0: {
        v1::Attach* at = f.mutable_attach();
        const int n = in.ConsumeIntegralInRange<int>(0, 3);
        for (int i = 0; i < n; ++i) at->add_sessions(SessionFrom(in));
        const int t = in.ConsumeIntegralInRange<int>(0, 2);
        at->set_token(t == 0 ? "secret-a" : t == 1 ? "secret-any" : in.ConsumeRandomLengthString(12));
        at->set_accepts_batches(in.ConsumeBool());
        break;
      }
      case 1:
      case 2: {
        v1::Contribution* c = f.mutable_contribution();
        c->set_session(SessionFrom(in));
        c->set_op(in.ConsumeIntegralInRange<uint32_t>(0, 2));
        c->set_seq(in.ConsumeIntegralInRange<uint64_t>(0, 2));
        c->set_phase(v1::Phase(in.ConsumeIntegralInRange<int>(0, 3)));
        c->set_scope(AnyScope(in));
        const uint32_t channels = in.ConsumeProbability<float>() < 0.9f
                                      ? 1 + c->op() % 2
                                      : in.ConsumeIntegral<uint32_t>();
        c->set_channels(channels);
        c->set_count(in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(0, 9)
                                      : in.ConsumeIntegral<int64_t>());
        if (in.ConsumeProbability<float>() < 0.9f) {
          std::string data(size_t(hsbn::wire::PayloadBytes(std::min<uint32_t>(channels, 8))), 0);
          for (size_t i = 0; i < data.size(); i += 8) {
            const double v = double(in.ConsumeIntegralInRange<int>(-4, 4));
            std::memcpy(&data[i], &v, 8);
          }
          c->set_data(data);
        } else {
          c->set_data(in.ConsumeRandomLengthString(64));
        }
        break;
      }
      case 3: {
        v1::Abort* ab = f.mutable_abort();
        ab->set_session(SessionFrom(in));
        ab->set_op(in.ConsumeIntegralInRange<uint32_t>(0, 2));
        ab->set_seq(in.ConsumeIntegralInRange<uint64_t>(0, 2));
        ab->set_phase(v1::Phase(in.ConsumeIntegralInRange<int>(0, 3)));
        ab->set_code(in.ConsumeIntegral<int32_t>());
        ab->set_message(in.ConsumeRandomLengthString(40));
        break;
      }
      case 4: {
        if (in.ConsumeProbability<float>() < 0.25f) {  // a sidecar leaving a job
          f.mutable_leave()->set_session(SessionFrom(in));
          break;
        }
        if (in.ConsumeProbability<float>() < 0.25f) {  // a worker waiting for a late result
          v1::LateWanted* w = f.mutable_late_wanted();
          w->set_session(SessionFrom(in));
          w->set_op(in.ConsumeIntegralInRange<uint32_t>(0, 2));
          w->set_seq(in.ConsumeIntegralInRange<uint64_t>(0, 2));
          w->set_phase(v1::Phase(in.ConsumeIntegralInRange<int>(0, 3)));
          break;
        }
        v1::NodeState* ns = f.mutable_node_state();
        ns->set_session(SessionFrom(in));
        ns->set_healthy(in.ConsumeBool());
        ns->set_message(in.ConsumeRandomLengthString(40));
        break;
      }
      default: {
        const int n = in.ConsumeIntegralInRange<int>(0, 4);
        for (int i = 0; i < n; ++i) *f.mutable_batch()->add_frames() = MakeFrame(in, depth + 1);
        break;
      }
    }
    return f;
  }

  void Read(FuzzedDataProvider& in) {
    Stream& s = streams[in.ConsumeIntegralInRange<int>(0, kStreams - 1)];
    if (s.closed) return;
    v1::ClientFrame frame;
    if (in.ConsumeProbability<float>() < 0.3f) {
      if (!frame.ParseFromString(in.ConsumeRandomLengthString(300))) return;  // gRPC drops it
      Resolve(&frame);
    } else {
      frame = MakeFrame(in);
    }
    reading = &s;
    const absl::Status status = s.policy->Read(frame);
    reading = nullptr;
    if (!status.ok()) Close(s);  // terminated: no more reads
  }

  // ---- MemberStreamHost: what the aggregator does for a stream ----

  Registry& registry() override { return *registry_; }
  Clock::time_point Now() override { return now; }
  void Execute(const std::shared_ptr<Job>& job, Actions& a) override { Check(job, a); }
  void LogInvalid(const std::string&) override {}
  void Refused(const char*) override {}
  void Leave(const SessionId& session) override {  // Aggregator::Leave of a Leave frame
    Registry::SessionRef ref;
    const bool known = registry_->Find(session, &ref);
    Actions a;
    std::string job_id;
    if (!registry_->Leave(session, &a, &job_id).ok()) return;
    HSBN_FUZZ_CHECK(known, "Leave accepted an unknown session");
    JobWatch& w = Watch(ref.job);
    if (w.model[ref.index].session == session) w.model[ref.index].attached = false;
    Check(ref.job, a);
  }
  // A LateWanted frame reaches the aggregator only for a job a session of its stream was bound
  // to (that session may have been replaced since: the frame then only lets the job's held
  // partials leave early, nothing else), and with a phase.
  void LateWanted(const std::string& job_id, const RoundKey& key) override {
    const std::vector<std::string>& jobs = reading->sink->jobs;
    HSBN_FUZZ_CHECK(std::find(jobs.begin(), jobs.end(), job_id) != jobs.end(),
                    "LateWanted passed for a job no session of its stream was bound to");
    HSBN_FUZZ_CHECK(key.phase == v1::PHASE_FORWARD || key.phase == v1::PHASE_BACKWARD,
                    "LateWanted passed without a phase");
  }
  void Attached(const Registry::SessionRef& ref, const SessionId& session) override {
    JobWatch& w = Watch(ref.job);
    HSBN_FUZZ_CHECK(w.model[ref.index].session == session,
                    "Attach bound a session that is not its member's current one");
    w.model[ref.index].attached = true;
    reading->sink->bound.emplace_back(session, ref.index);
    reading->sink->jobs.push_back(ref.job->id());
  }
  void Contributed(const Registry::SessionRef& ref, const SessionId& session,
                   const v1::Contribution& c) override {
    JobWatch& w = Watch(ref.job);
    HSBN_FUZZ_CHECK(w.model[ref.index].session == session,
                    "Contribute accepted a replaced session");
    w.ledger->Contributed(RoundKey{c.op(), c.seq(), c.phase()}, ref.index);
  }

  // The stream broke or the client half-closed: Aggregator::StreamClosed.
  void Close(Stream& s) {
    s.closed = true;
    for (const SessionId& session : s.policy->sessions()) {
      Registry::SessionRef ref;
      if (!registry_->Find(session, &ref)) continue;
      Actions a;
      ref.job->MemberGone(ref.index, session, /*left=*/false, now, &a);
      JobWatch& w = Watch(ref.job);
      if (w.model[ref.index].session == session) w.model[ref.index].attached = false;
      Check(ref.job, a);
    }
  }

  void Reopen(Stream& s) {
    s.sink = std::make_shared<StreamSink>();
    s.policy = std::make_unique<MemberStream>(this, s.sink, kMaxUnboundBytes);
    s.closed = false;
  }

  // ---- the upstream link and the clock ----

  void Upstream(FuzzedDataProvider& in) {
    std::vector<std::shared_ptr<Job>> jobs = registry_->Jobs();
    if (jobs.empty() || !has_parent) return;
    v1::ServerFrame frame;
    if (in.ConsumeProbability<float>() < 0.3f) {
      if (!frame.ParseFromString(in.ConsumeRandomLengthString(300))) return;
    } else {
      const int n = in.ConsumeIntegralInRange<int>(0, 3);
      for (int i = 0; i < n; ++i) {
        v1::Result* r = n == 1 ? frame.mutable_result() : frame.mutable_batch()->add_results();
        r->set_op(in.ConsumeIntegralInRange<uint32_t>(0, 2));
        r->set_seq(in.ConsumeIntegralInRange<uint64_t>(0, 2));
        r->set_phase(v1::Phase(in.ConsumeIntegralInRange<int>(0, 3)));
        r->set_scope(AnyScope(in));
        r->set_channels(in.ConsumeBool() ? 1 + r->op() % 2 : in.ConsumeIntegral<uint32_t>());
        r->set_count(in.ConsumeIntegralInRange<int64_t>(-1, 9));
        r->set_code(in.ConsumeBool() ? 0 : in.ConsumeIntegral<int32_t>());
        r->set_message(in.ConsumeRandomLengthString(20));
        r->set_late(in.ConsumeProbability<float>() < 0.3f);  // a renorm/lagged round's late result
        r->set_data(in.ConsumeBool() ? std::string(size_t(hsbn::wire::PayloadBytes(r->channels() & 7)), '\x3f')
                                     : in.ConsumeRandomLengthString(40));
      }
    }
    const std::shared_ptr<Job>& job = jobs[in.ConsumeIntegralInRange<size_t>(0, jobs.size() - 1)];
    auto deliver = [&](const v1::Result& r) {
      Actions a;
      job->ParentResult(r, &a);
      Check(job, a);
    };
    if (frame.has_result()) deliver(frame.result());
    for (const v1::Result& r : frame.batch().results()) deliver(r);
  }

  void Tick(FuzzedDataProvider& in) {
    now += std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(0, 3000));
    registry_->Sweep(now);
    for (const auto& job : registry_->Jobs()) {
      Actions a;
      job->Expire(now, &a);
      Check(job, a);
    }
    Check(nullptr, Actions{});
  }

  void Run(FuzzedDataProvider& in) {
    while (in.remaining_bytes() > 0) {
      switch (in.ConsumeIntegralInRange<int>(0, 12)) {
        case 0:
        case 1: Join(in); break;
        case 2:
        case 3:
        case 4:
        case 5: Read(in); break;
        case 6: Close(streams[in.ConsumeIntegralInRange<int>(0, kStreams - 1)]); break;
        case 7: Reopen(streams[in.ConsumeIntegralInRange<int>(0, kStreams - 1)]); break;
        case 8: Leave(in); break;
        case 9: Tick(in); break;
        case 10: Upstream(in); break;
        case 11: Status(in); break;
        default: {
          if (in.ConsumeBool()) {
            for (const auto& job : registry_->Jobs()) {
              Actions a;
              job->ParentLost(absl::UnavailableError("link lost"), &a);
              Check(job, a);
            }
          } else {
            (void)TokenStore::Parse(in.ConsumeRandomLengthString(200), "fuzz");
          }
          break;
        }
      }
    }
  }
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  SetLogLevel(LogLevel::kError);  // the Registry logs every new job
  // Invalid UTF-8 in a string field fails the parse, as in gRPC; protobuf's log line about it
  // only slows the fuzzer down.
  google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int,
                                     const std::string&) {});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Harness h;
  RegistryOptions o;
  h.root = in.ConsumeBool();
  o.joins = h.root ? v1::MEMBER_KIND_AGGREGATOR : v1::MEMBER_KIND_WORKER;
  h.has_parent = !h.root && in.ConsumeBool();
  // A group aggregator: sidecars join it, and it has a root above it or not.
  o.group_tier = h.root && in.ConsumeBool();
  if (o.group_tier) h.has_parent = in.ConsumeBool();
  o.limits.has_parent = h.has_parent;
  o.max_jobs = in.ConsumeIntegralInRange<int>(1, 3);
  o.max_world_size = in.ConsumeIntegralInRange<int>(1, 12);
  o.attach_timeout = std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(0, 5000));
  o.memory_budget_bytes = in.ConsumeIntegralInRange<int64_t>(0, 16384);
  o.limits.round_timeout = std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(1, 2000));
  o.limits.max_channels = in.ConsumeIntegralInRange<int>(1, 4);
  o.limits.max_open_rounds = in.ConsumeIntegralInRange<int>(1, 6);
  o.limits.finished_rounds_kept = in.ConsumeIntegralInRange<int>(0, 6);
  if (in.ConsumeBool()) o.tokens = Tokens();
  h.registry_ = std::make_unique<Registry>(o);
  h.budget = h.registry_->budget();
  for (Stream& s : h.streams) h.Reopen(s);

  h.Run(in);

  for (Stream& s : h.streams) s = Stream{};
  h.registry_.reset();
  HSBN_FUZZ_CHECK(h.budget->used() == 0, "the budget counts " + std::to_string(h.budget->used()) +
                                             " bytes after every job was dropped");
  return 0;
}
