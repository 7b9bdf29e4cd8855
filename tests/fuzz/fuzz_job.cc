// tests/fuzz/fuzz_job.cc — the aggregator's request path without sockets.
//
// One Job (server/job.h) with a layout and limits taken from the input (a node's sidecar with
// or without a root above it, a group aggregator with or without a root, or the root above
// sidecars or above group aggregators; strict or not; a small MemoryBudget, few open
// rounds, few kept tombstones), then a sequence of the calls the aggregator makes on it, with
// arbitrary fields, from several members, as the input says: AddMember (new sessions and
// reconnects), Attach (current or stale sessions), Contribute, ChildAbort and ChildState (at
// the root), MemberGone (a broken stream or a Leave), ParentResult and ParentLost (at a
// sidecar with a root), Expire with time advanced, FailAll, and the readers (Droppable,
// NodeDown, FillStatus). Only the preconditions the aggregator itself guarantees are kept:
// member indexes are in range (the Registry checks them) and Child*/Parent* calls reach only
// jobs of the matching role.
//
// Checked on every input (tests/fuzz/invariants.h): no OK round with a missing member, OK
// results well formed and identical for every member, results only to current attached
// sessions; the job's held bytes equal the budget's use after every call, and the budget is
// back at zero when the job is destroyed.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "invariants.h"
#include "job.h"
#include "session.h"
#include "wire.h"

namespace {

using hsbn::fuzz::NullSink;
using hsbn::fuzz::RoundLedger;
using namespace hsbn::server;
namespace v1 = hsbn::v1;

// Every scope value a client can send: the five the wire knows, the reserved 5 (auto, never on
// the wire), renorm and lagged (late results, kept lagged forward records) and one unknown.
v1::Scope AnyScope(FuzzedDataProvider& in) {
  return v1::Scope(in.ConsumeIntegralInRange<int>(0, 8));
}

double Value(FuzzedDataProvider& in) {
  static const double kPalette[] = {0.0,
                                    1.0,
                                    -1.0,
                                    0.5,
                                    3.0,
                                    -0.0,
                                    1e308,
                                    -1e308,
                                    std::numeric_limits<double>::infinity(),
                                    -std::numeric_limits<double>::infinity(),
                                    std::numeric_limits<double>::quiet_NaN(),
                                    std::numeric_limits<double>::denorm_min(),
                                    std::numeric_limits<double>::max()};
  const uint8_t pick = in.ConsumeIntegral<uint8_t>();
  if (pick < 200) return kPalette[pick % (sizeof kPalette / sizeof kPalette[0])];
  double v;
  const uint64_t bits = in.ConsumeIntegral<uint64_t>();
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

int64_t Count(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: return in.ConsumeIntegralInRange<int64_t>(0, 16);
    case 1: return std::numeric_limits<int64_t>::max() - in.ConsumeIntegralInRange<int64_t>(0, 2);
    case 2: return -in.ConsumeIntegralInRange<int64_t>(1, 2);
    default: return in.ConsumeIntegral<int64_t>();
  }
}

// A payload for `channels` channels, of the right size unless the input says otherwise.
std::string Payload(FuzzedDataProvider& in, uint32_t channels) {
  std::string data;
  if (in.ConsumeBool()) {
    std::vector<double> a(channels), b(channels);
    for (auto& v : a) v = Value(in);
    for (auto& v : b) v = Value(in);
    hsbn::wire::PackPayload(a.data(), b.data(), channels, &data);
  } else {
    data = in.ConsumeBytesAsString(in.ConsumeIntegralInRange<size_t>(0, 80));
  }
  return data;
}

struct Harness {
  JobLayout layout;
  JobLimits limits;
  std::shared_ptr<MemoryBudget> budget;
  std::unique_ptr<Job> job;
  std::vector<std::shared_ptr<NullSink>> sinks;
  std::vector<RoundLedger::MemberModel> model;
  std::vector<std::vector<SessionId>> sessions;  // every session each member was ever given
  std::vector<Actions::Forward> forwards;        // what the job sent to its parent
  std::unique_ptr<RoundLedger> ledger;
  Clock::time_point now = Clock::now();
  uint64_t next_session = 1;

  bool worker() const { return layout.member_kind == v1::MEMBER_KIND_WORKER; }

  // The round a member's contribution belongs to, as the Job keys it: at the root, each group's
  // group-scope round is its own (docs/PROTOCOL.md, "Group scope").
  RoundKey KeyOf(int member, const v1::Contribution& c) const {
    RoundKey key{c.op(), c.seq(), c.phase()};
    if (c.scope() == v1::SCOPE_GROUP && layout.keyed_groups()) {
      key.group = member * std::max(1, layout.member_nodes) / layout.group_nodes + 1;
    }
    return key;
  }

  void Check(const Actions& a) {
    ledger->Check(a, model);
    for (const auto& f : a.forwards) forwards.push_back(f);
    const int64_t held = job->held_bytes();
    HSBN_FUZZ_CHECK(held >= 0, "the job holds " + std::to_string(held) + " bytes");
    HSBN_FUZZ_CHECK(held == budget->used(),
                    "the job holds " + std::to_string(held) + " bytes but the budget counts " +
                        std::to_string(budget->used()));
  }

  const SessionId& PickSession(FuzzedDataProvider& in, int member) {
    const auto& all = sessions[member];
    if (all.empty() || in.ConsumeBool()) return model[member].session;
    return all[in.ConsumeIntegralInRange<size_t>(0, all.size() - 1)];
  }

  v1::Contribution MakeContribution(FuzzedDataProvider& in) {
    v1::Contribution c;
    c.set_op(in.ConsumeIntegralInRange<uint32_t>(0, 3));
    c.set_seq(in.ConsumeIntegralInRange<uint64_t>(0, 3));
    c.set_phase(v1::Phase(in.ConsumeIntegralInRange<int>(0, 3)));
    c.set_scope(AnyScope(in));
    uint32_t channels = 1 + c.op() % 3;  // a layer's channels, usually the same every time
    if (in.ConsumeProbability<float>() < 0.1f) {
      channels = in.ConsumeBool() ? in.ConsumeIntegralInRange<uint32_t>(0, 12)
                                  : in.ConsumeIntegral<uint32_t>();
    }
    c.set_channels(channels);
    c.set_count(Count(in));
    *c.mutable_data() = Payload(in, std::min<uint32_t>(channels, 16));
    if (in.ConsumeProbability<float>() < 0.05f) c.set_session(in.ConsumeBytesAsString(16));
    return c;
  }

  v1::Result MakeParentResult(FuzzedDataProvider& in) {
    v1::Result r;
    if (!forwards.empty() && in.ConsumeProbability<float>() < 0.9f) {
      const auto& f = forwards[in.ConsumeIntegralInRange<size_t>(0, forwards.size() - 1)];
      r.set_op(f.key.op);
      r.set_seq(f.key.seq);
      r.set_phase(f.key.phase);
      r.set_channels(f.channels);
      r.set_count(f.count);
      r.set_data(*f.data);
      r.set_scope(f.scope);
    } else {
      r.set_op(in.ConsumeIntegralInRange<uint32_t>(0, 3));
      r.set_seq(in.ConsumeIntegralInRange<uint64_t>(0, 3));
      r.set_phase(v1::Phase(in.ConsumeIntegralInRange<int>(0, 3)));
      r.set_channels(1 + r.op() % 3);
      r.set_count(Count(in));
      r.set_data(Payload(in, r.channels()));
    }
    switch (in.ConsumeIntegralInRange<int>(0, 7)) {
      case 0: r.set_code(in.ConsumeIntegral<int32_t>()); break;
      case 1: r.set_code(in.ConsumeIntegralInRange<int32_t>(1, 16));
              r.set_message(in.ConsumeRandomLengthString(64)); break;
      case 2: r.set_channels(in.ConsumeIntegral<uint32_t>()); break;
      case 3: r.set_count(Count(in)); break;
      case 4: r.set_data(Payload(in, r.channels() & 15)); break;
      case 5: r.set_scope(v1::Scope(in.ConsumeIntegral<int32_t>())); break;
      default: break;  // the root's honest answer
    }
    r.set_session(in.ConsumeBytesAsString(in.ConsumeBool() ? 16 : 3));
    // A renorm or lagged round's late result, honest (its scope) or not.
    if (r.scope() == v1::SCOPE_RENORM || r.scope() == v1::SCOPE_LAGGED || in.ConsumeProbability<float>() < 0.1f)
      r.set_late(in.ConsumeProbability<float>() < 0.8f);
    return r;
  }

  void Run(FuzzedDataProvider& in) {
    while (in.remaining_bytes() > 0) {
      const int member = in.ConsumeIntegralInRange<int>(0, layout.expected_members() - 1);
      Actions a;
      switch (in.ConsumeIntegralInRange<int>(0, 11)) {
        case 0: {  // a Join (a reconnect names its previous session)
          SessionId session{uint64_t(member) + 1, next_session++};
          SessionId previous;
          if (in.ConsumeBool()) previous = PickSession(in, member);
          if (job->AddMember(member, session, previous, now, &a).ok()) {
            model[member].session = session;
            model[member].attached = false;
            sessions[member].push_back(session);
          }
          break;
        }
        case 1: {  // an Attach on a stream
          const SessionId session = PickSession(in, member);
          if (job->Attach(member, session, sinks[member], now).ok()) {
            HSBN_FUZZ_CHECK(session == model[member].session,
                            "Attach accepted a session that is not the member's current one");
            model[member].attached = true;
          }
          break;
        }
        case 2:
        case 3:
        case 4: {  // a contribution (the most common frame)
          const v1::Contribution c = MakeContribution(in);
          const SessionId session = PickSession(in, member);
          if (job->Contribute(member, session, c, now, &a)) {
            HSBN_FUZZ_CHECK(session == model[member].session,
                            "Contribute accepted a stale session");
            ledger->Contributed(KeyOf(member, c), member);
          }
          break;
        }
        case 5: {  // a stream broke, or the member left
          const SessionId session = PickSession(in, member);
          const bool left = in.ConsumeBool();
          job->MemberGone(member, session, left, now, &a);
          if (session == model[member].session) model[member].attached = false;
          break;
        }
        case 6: {  // time passes
          now += std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(0, 2000));
          job->Expire(now, &a);
          break;
        }
        case 7: {  // from a child aggregator (root) / from the parent (sidecar)
          if (!worker() && (!limits.has_parent || in.ConsumeBool())) {
            v1::Abort abort;
            abort.set_op(in.ConsumeIntegralInRange<uint32_t>(0, 3));
            abort.set_seq(in.ConsumeIntegralInRange<uint64_t>(0, 3));
            abort.set_phase(v1::Phase(in.ConsumeIntegralInRange<int>(0, 3)));
            abort.set_code(in.ConsumeBool() ? in.ConsumeIntegralInRange<int32_t>(0, 16)
                                            : in.ConsumeIntegral<int32_t>());
            abort.set_message(in.ConsumeRandomLengthString(64));
            job->ChildAbort(member, abort, &a);
          } else if (limits.has_parent) {
            job->ParentResult(MakeParentResult(in), &a);
          }
          break;
        }
        case 8: {
          if (!worker() && (!limits.has_parent || in.ConsumeBool())) {
            v1::NodeState state;
            state.set_healthy(in.ConsumeBool());
            state.set_message(in.ConsumeRandomLengthString(64));
            job->ChildState(member, state, &a);
          } else if (limits.has_parent) {
            job->ParentLost(absl::UnavailableError("the root went away"), &a);
          }
          break;
        }
        case 9: {
          job->FailAll(absl::UnavailableError("shutting down"), &a);
          break;
        }
        case 10: {
          (void)job->Droppable(now, std::chrono::milliseconds(in.ConsumeIntegral<uint16_t>()));
          std::string message;
          (void)job->NodeDown(&message);
          break;
        }
        default: {
          v1::JobStatus status;
          job->FillStatus(&status);
          HSBN_FUZZ_CHECK(status.members_size() == layout.expected_members(),
                          "Status lists a different number of members");
          break;
        }
      }
      Check(a);
    }
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Harness h;
  // The job's shape: a sidecar (with or without a root) or the root; 1-4 members.
  const bool root = in.ConsumeBool();
  // 1-4 members, and whether the job has groups of nodes. One byte, read as the member count
  // alone was (1 + byte % 4), so that inputs saved before groups existed replay as they did
  // whenever byte % 8 < 4.
  const int shape = in.ConsumeIntegralInRange<int>(0, 7);
  const int group = 1 + shape % 4;
  const bool grouped = shape >= 4;
  h.layout.member_kind = root ? v1::MEMBER_KIND_AGGREGATOR : v1::MEMBER_KIND_WORKER;
  h.layout.strict_finite = in.ConsumeBool();
  if (root) {
    h.layout.num_nodes = group;
    h.layout.local_world_size = in.ConsumeIntegralInRange<int>(1, 3);
    h.layout.node_rank = -1;
  } else {
    h.layout.local_world_size = group;
    h.layout.num_nodes = in.ConsumeIntegralInRange<int>(1, 3);
    h.layout.node_rank = in.ConsumeIntegralInRange<int>(0, h.layout.num_nodes - 1);
  }
  h.layout.world_size = h.layout.local_world_size * h.layout.num_nodes;
  // Groups of nodes: a divisor of the number of nodes.
  if (grouped) {
    std::vector<int> divisors;
    for (int g = 1; g <= h.layout.num_nodes; ++g) {
      if (h.layout.num_nodes % g == 0) divisors.push_back(g);
    }
    h.layout.group_nodes = divisors[in.ConsumeIntegralInRange<size_t>(0, divisors.size() - 1)];
  }
  h.limits.has_parent = !root && in.ConsumeBool();
  // Above the sidecars, a tree with a group tier (docs/PROTOCOL.md, "Group tier"): this job at
  // a group aggregator (its members the nodes of group `layout.group`, a root above it or not),
  // or at a root whose members are group aggregators of K nodes each.
  if (root && in.ConsumeIntegralInRange<int>(0, 2) > 0 && in.remaining_bytes() > 0) {
    const int k = in.ConsumeIntegralInRange<int>(1, 3);
    if (in.ConsumeBool()) {  // a group aggregator: `group` members are the group's nodes
      const int groups = in.ConsumeIntegralInRange<int>(1, 3);
      h.layout.group_nodes = group;
      h.layout.num_nodes = group * groups;
      h.layout.member_nodes = 1;
      h.layout.group = in.ConsumeIntegralInRange<int>(0, groups - 1);
      h.limits.has_parent = in.ConsumeBool();
    } else {  // a root above group aggregators: `group` members of k nodes each
      h.layout.group_nodes = k;
      h.layout.num_nodes = group * k;
      h.layout.member_nodes = k;
    }
    h.layout.world_size = h.layout.local_world_size * h.layout.num_nodes;
  } else if (root) {
    h.layout.member_nodes = 1;
  }
  h.limits.round_timeout = std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(1, 1000));
  h.limits.max_channels = in.ConsumeIntegralInRange<int>(1, 8);
  h.limits.max_open_rounds = in.ConsumeIntegralInRange<int>(1, 8);
  const bool keeps_all = in.ConsumeBool();
  if (!keeps_all) {  // tombstones are evicted: a round key may run again
    h.limits.finished_rounds_kept = in.ConsumeIntegralInRange<int>(0, 4);
    h.limits.finished_bytes_kept = in.ConsumeIntegralInRange<int64_t>(0, 256);
  }
  h.budget = std::make_shared<MemoryBudget>(in.ConsumeIntegralInRange<int64_t>(0, 8192));
  h.limits.budget = h.budget;
  h.job = std::make_unique<Job>("fuzz-job", h.layout, h.limits);
  h.ledger = std::make_unique<RoundLedger>(
      group, keeps_all,
      h.layout.keyed_groups() ? h.layout.group_nodes / std::max(1, h.layout.member_nodes) : 0);
  h.model.resize(group);
  h.sessions.resize(group);
  for (int i = 0; i < group; ++i) h.sinks.push_back(std::make_shared<NullSink>(i));

  h.Run(in);

  h.job.reset();
  HSBN_FUZZ_CHECK(h.budget->used() == 0, "the budget counts " +
                                             std::to_string(h.budget->used()) +
                                             " bytes after the job was destroyed");
  return 0;
}
