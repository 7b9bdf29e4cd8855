// tests/fuzz/invariants.h — what every fuzzer of the aggregator checks about a Job's Actions.
//
// A RoundLedger watches every Actions value a Job (or a Registry in front of it) returns, and
// aborts the process (which libFuzzer reports as a crash, with the input) when:
//   - an OK result is delivered or forwarded for a round that a member never contributed to
//     (no round completes with a missing member);
//   - an OK result is malformed: no channels, a payload that is not channels * 16 bytes, a
//     negative count, a phase or scope that is not one of the protocol's (a late result, the
//     global statistics of a renorm or lagged round, is of scope global);
//   - two OK results for the same round differ in any byte (count, scope, channels, payload),
//     whether delivered in one call or later to a late or repeated contribution, as long as the
//     job keeps every finished round (`keeps_all`: no tombstone was evicted, so nothing may
//     legitimately run the round again); a round's late result is compared with its late
//     results only (the round's first answer is the node's statistics, the late one the job's);
//   - a result goes to a session that is not its member's current, attached session.
// The caller tells the ledger what the job was told (contributions it accepted, sessions, sinks).
#ifndef HSBN_TESTS_FUZZ_INVARIANTS_H_
#define HSBN_TESTS_FUZZ_INVARIANTS_H_

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "job.h"
#include "member_stream.h"
#include "wire.h"

namespace hsbn::fuzz {

// A member's sink: results land here (the fuzzers look at Actions, not at sinks).
class NullSink : public server::ResultSink {
 public:
  explicit NullSink(int member) : member(member) {}
  void Send(v1::Result) override {}
  const int member;
};

// A stream's sink (fuzz_frames: server::MemberStream binds sessions of any member to it).
class StreamSink : public server::MemberSink {
 public:
  void Send(v1::Result) override {}
  void EnableBatches() override {}
  std::vector<std::pair<server::SessionId, int>> bound;  // (session, member) of each Attach
  std::vector<std::string> jobs;  // the job of each Attach (its id)
};

class RoundLedger {
 public:
  // `group_nodes` > 0: a root whose job has groups of that many members (nodes), so a
  // group-scope round is one group's round, keyed with its group (server::RoundKey::group).
  RoundLedger(int members, bool keeps_all, int group_nodes = 0)
      : members_(members), keeps_all_(keeps_all), group_nodes_(group_nodes) {}

  // Member `index` had a contribution to `key` accepted (Job::Contribute returned true).
  void Contributed(const server::RoundKey& key, int index) { contributed_[key].insert(index); }

  // The member's current session and whether a live sink is bound to it, as the caller
  // modelled them from the calls it made.
  struct MemberModel {
    server::SessionId session;
    bool attached = false;
  };

  void Check(const server::Actions& a, const std::vector<MemberModel>& model) {
    std::map<std::pair<server::RoundKey, bool>, std::string> ok_in_call;
    for (const auto& d : a.deliveries) {
      HSBN_FUZZ_CHECK(d.result != nullptr, "a delivery without a result");
      const v1::Result& r = *d.result;
      server::RoundKey key{r.op(), r.seq(), r.phase()};
      for (const auto& [session, sink] : d.to) {
        const int member = MemberOf(session, sink);
        HSBN_FUZZ_CHECK(member >= 0 && member < int(model.size()),
                        "a result for a sink the job was never given");
        HSBN_FUZZ_CHECK(model[member].attached,
                        "a result for member " + std::to_string(member) +
                            ", which has no attached session");
        HSBN_FUZZ_CHECK(session == model[member].session,
                        "a result for member " + std::to_string(member) +
                            " under a session that is not its current one");
      }
      if (r.code() != 0) {
        HSBN_FUZZ_CHECK(r.data().empty(), "a failed round's result carries a payload");
        continue;
      }
      if (r.scope() == v1::SCOPE_GROUP && group_nodes_ > 0) {
        // At the root, a group's round goes to that group's members only. (At a sidecar a group
        // round is the node's, with all its members.)
        HSBN_FUZZ_CHECK(!d.to.empty(), "an OK group result delivered to nobody");
        std::set<int> groups;
        for (const auto& [session, sink] : d.to) {
          groups.insert(MemberOf(session, sink) / group_nodes_ + 1);
        }
        HSBN_FUZZ_CHECK(groups.size() == 1, "one group result delivered to several groups");
        key.group = *groups.begin();
      }
      CheckOk(key, r.channels(), r.count(), r.data(), "delivered");
      HSBN_FUZZ_CHECK(r.scope() == v1::SCOPE_NODE || r.scope() == v1::SCOPE_GLOBAL ||
                          r.scope() == v1::SCOPE_SHADOW || r.scope() == v1::SCOPE_GROUP ||
                          r.scope() == v1::SCOPE_RENORM || r.scope() == v1::SCOPE_LAGGED,
                      "an OK result with scope " + std::to_string(int(r.scope())));
      HSBN_FUZZ_CHECK(!r.late() || r.scope() == v1::SCOPE_GLOBAL,
                      "an OK late result with scope " + std::to_string(int(r.scope())));
      v1::Result canonical = r;
      canonical.clear_session();
      const std::string bytes = canonical.SerializeAsString();
      auto [it, fresh] = ok_in_call.emplace(std::make_pair(key, r.late()), bytes);
      HSBN_FUZZ_CHECK(fresh || it->second == bytes,
                      "two different OK results for round " + server::Describe(key) +
                          " in one call");
      if (keeps_all_) {
        auto [kept, first] = ok_.emplace(std::make_pair(key, r.late()), bytes);
        HSBN_FUZZ_CHECK(first || kept->second == bytes,
                        "round " + server::Describe(key) +
                            " answered OK twice with different bytes");
      }
    }
    for (const auto& f : a.forwards) {
      HSBN_FUZZ_CHECK(f.data != nullptr, "a forward without a payload");
      CheckOk(f.key, f.channels, f.count, *f.data, "forwarded");
    }
  }

 private:
  // The member a result sent to (session, sink) is for: a NullSink's own, or the member whose
  // session an Attach bound to a StreamSink; -1 if neither.
  static int MemberOf(const server::SessionId& session,
                      const std::shared_ptr<server::ResultSink>& sink) {
    if (auto* s = dynamic_cast<NullSink*>(sink.get())) return s->member;
    if (auto* s = dynamic_cast<StreamSink*>(sink.get())) {
      for (const auto& [bound, member] : s->bound) {
        if (bound == session) return member;
      }
    }
    return -1;
  }

  void CheckOk(const server::RoundKey& key, uint32_t channels, int64_t count,
               const std::string& data, const char* how) {
    const std::string round = server::Describe(key);
    HSBN_FUZZ_CHECK(channels > 0, std::string(how) + " OK round " + round + " has 0 channels");
    HSBN_FUZZ_CHECK(int64_t(data.size()) == wire::PayloadBytes(channels),
                    std::string(how) + " OK round " + round + " has " +
                        std::to_string(data.size()) + " bytes for " + std::to_string(channels) +
                        " channels");
    HSBN_FUZZ_CHECK(count >= 0, std::string(how) + " OK round " + round + " has count " +
                                    std::to_string(count));
    HSBN_FUZZ_CHECK(key.phase == v1::PHASE_FORWARD || key.phase == v1::PHASE_BACKWARD,
                    std::string(how) + " OK round " + round + " has no valid phase");
    const std::set<int>& who = contributed_[key];
    // Every member of the round: the whole job, or the key's group.
    const int lo = key.group > 0 ? (key.group - 1) * group_nodes_ : 0;
    const int hi = key.group > 0 ? std::min(members_, lo + group_nodes_) : members_;
    for (int m = lo; m < hi; ++m) {
      HSBN_FUZZ_CHECK(who.count(m) != 0, std::string(how) + " OK round " + round +
                                             " although member " + std::to_string(m) +
                                             " never contributed to it");
    }
  }

  const int members_;
  const bool keeps_all_;
  const int group_nodes_;
  std::map<server::RoundKey, std::set<int>> contributed_;
  std::map<std::pair<server::RoundKey, bool>, std::string> ok_;  // (round, late) -> result
};

}  // namespace hsbn::fuzz

#endif  // HSBN_TESTS_FUZZ_INVARIANTS_H_
