// round.h — the round core: what a round checks, how it reduces, and how it names its members
// and its failures. The aggregator's Job (rounds over the gRPC stream) and the shared-memory
// node path (shm_segment.h) both call it, so a contribution is checked by the same rules, a
// result has the same bits, and an error has the same words whichever transport carried the
// round.
//
// Errors are built by named constructors (as LevelDB's Status::Corruption): a caller's body is
// its logic, and a message is written once. Callers branch on the code, never on the text.
//
// Thread safety: pure functions.
#ifndef HSBN_ROUND_H_
#define HSBN_ROUND_H_

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "hsbn/moments.h"
#include "hsbn/v1/hsbn.pb.h"

namespace hsbn::wire {

// ---- Members ----------------------------------------------------------------------------

// How an aggregator names the members of a job: the local ranks of one node (a sidecar) or the
// nodes (the root). Cheap to copy; names are built only for messages.
struct MemberNames {
  bool nodes = false;             // members are aggregators (nodes or groups), else local ranks
  int32_t node_rank = 0;          // the node whose local ranks these are; with `nodes`, the
                                  // first node this aggregator covers (a group aggregator's)
  int32_t local_world_size = 1;   // ranks per node
  int32_t member_nodes = 1;       // with `nodes`: nodes per member (K: members are groups)
  // "rank 5 (node 1, local rank 1)", "node 1 (ranks 4-7)" or "group 1 (nodes 2-3)".
  std::string operator()(int32_t index) const;
  // The global rank of a local rank, or -1 for nodes.
  int64_t Rank(int32_t index) const {
    return nodes ? -1 : int64_t(node_rank) * local_world_size + index;
  }
};

// What every member's error names: the round and its job. `round` is wire::RoundName's text,
// plus ", group G" for a group's round at the root.
struct RoundRef {
  std::string round;
  absl::string_view job;
};

// ---- Errors (named constructors) ------------------------------------------------------------

// INVALID_ARGUMENT: "<who> sent an invalid contribution to round R: field 'F' <what>".
absl::Status InvalidContribution(const std::string& who, const std::string& round,
                                 absl::string_view field, absl::string_view what);
// INVALID_ARGUMENT: `who`'s `field` disagrees with what the round's first contributor sent.
// `field` is "channels" or "scope"; `got` and `first` are their texts.
absl::Status DiffersFromFirst(const std::string& who, const std::string& round,
                              absl::string_view field, absl::string_view got,
                              const std::string& first_who, absl::string_view first);
// "node", "global", "shadow", "group" (wire::ScopeName), or the number of an unknown scope.
std::string ScopeWord(int32_t scope);
// RESOURCE_EXHAUSTED: more channels than --max-channels.
absl::Status TooManyChannels(const std::string& who, int64_t channels, const std::string& round,
                             int64_t limit);
// INVALID_ARGUMENT: the members' counts overflow int64 when summed. `who` lists each member
// with its count.
absl::Status CountsOverflow(const RoundRef& r, const std::vector<std::string>& who);
// INVALID_ARGUMENT (strict jobs): finite contributions merged to Inf or NaN.
absl::Status MergedNonFinite(const RoundRef& r);
// UNAVAILABLE: the round cannot complete because a member that took part before is gone (it
// left, or its stream broke), or is down (a node that reported a worker gone: `down` says why).
enum class Gone { kLeft, kDisconnected };
absl::Status MemberGone(const RoundRef& r, const std::string& who, Gone why);
absl::Status MemberDown(const RoundRef& r, const std::string& who, absl::string_view down);
// ABORTED: the round cannot complete because `who` aborted (hsbn_client_abort) for `reason`.
absl::Status MemberAborted(const RoundRef& r, const std::string& who, absl::string_view reason);
// DEADLINE_EXCEEDED: the round's members `missing` did not contribute within `timeout`.
absl::Status TimedOut(const RoundRef& r, std::chrono::milliseconds timeout,
                      const std::vector<std::string>& missing);
// DEADLINE_EXCEEDED: a forwarded round got no answer from the root within `waited`.
absl::Status RootSilent(const RoundRef& r, std::chrono::milliseconds waited);

// How long a member waits for a round it forwarded to the root: the round timeout plus a
// margin, so that the root's own deadline (which names the missing nodes) fires first and this
// one is only the backstop for a root that does not answer at all.
inline std::chrono::milliseconds ForwardedBackstop(std::chrono::milliseconds round_timeout) {
  return round_timeout + std::max<std::chrono::milliseconds>(std::chrono::seconds(1),
                                                              round_timeout / 10);
}

// ---- Contribution checks ------------------------------------------------------------------------

// One contribution as both transports hold it: `data` points at 2 * channels doubles, [a | b]
// (may be unaligned; read with memcpy).
struct ContributionView {
  int32_t scope = 0;   // v1::Scope
  int64_t channels = 0;
  int64_t count = 0;
  const char* data = nullptr;
};

// What a round admits: the scopes that are valid here, the channel limit (--max-channels)
// and a transport's own cap (the shared-memory segment's slot size; 0 for none), strictness.
struct RoundRules {
  bool forward = true;
  bool group_allowed = true;   // the stream carries group rounds; the segment does not
  bool strict_finite = false;
  int64_t max_channels = 0;    // the aggregator's --max-channels
  int64_t transport_cap = 0;   // > 0: channels a transport can carry (above it: INVALID_ARGUMENT)
};

// The checks every contribution passes before it touches a round, on either transport, in
// three parts: CheckFields (the scope, the channel count against the limit and the cap,
// count >= 0; `c.data` is not read), CheckSameRound (against the round's first contribution:
// the same channels and scope) and CheckValues (CheckContributionValues on `c.data`).
// `who`, `first_who` and `round` are callables returning the member's, the first
// contributor's and the round's names: called only on failure, so the common path builds no
// text.
template <typename Who, typename Round>
absl::Status CheckFields(const ContributionView& c, const RoundRules& rules, Who who, Round round);
template <typename Who, typename FirstWho, typename Round>
absl::Status CheckSameRound(const ContributionView& c, int64_t first_channels,
                            int32_t first_scope, Who who, FirstWho first_who, Round round);
template <typename Who, typename Round>
absl::Status CheckValues(const ContributionView& c, const RoundRules& rules, Who who,
                         Round round);

// ---- Reduction ----------------------------------------------------------------------------------

// Reduces `n` contributions in index order 0, 1, ..., n-1 into `a` and `b` (`channels` doubles
// each; overwritten). `get(i, &ai, &bi)` returns member i's count and points ai/bi at its two
// arrays. Forward rounds merge (count, mean, m2) with Chan's formula; backward rounds sum.
// Returns the total count. REQUIRES: the counts' sum fits in int64 (callers check first).
template <typename Get>
int64_t ReduceInOrder(bool forward, int64_t channels, int n, Get get, double* a, double* b) {
  for (int64_t c = 0; c < channels; ++c) a[c] = b[c] = 0.0;
  int64_t count = 0;
  for (int i = 0; i < n; ++i) {
    const double* ai = nullptr;
    const double* bi = nullptr;
    const int64_t ci = get(i, &ai, &bi);
    if (forward) {
      count = MergeChannelMoments(count, a, b, ci, ai, bi, channels);
    } else {
      AddChannelSums(a, ai, channels);
      AddChannelSums(b, bi, channels);
      count += ci;
    }
  }
  return count;
}

// Value i of the doubles at `raw` (which may be unaligned), as its bits or as a double: one
// unaligned load each (copying four at once into an array made GCC spill them to the stack).
inline uint64_t LoadWord(const char* raw, int64_t i) {
  uint64_t w;
  std::memcpy(&w, raw + i * 8, sizeof w);
  return w;
}

inline double LoadDouble(const char* raw, int64_t i) {
  double v;
  std::memcpy(&v, raw + i * 8, sizeof v);
  return v;
}

// How many of the `n` doubles at `raw` are NaN or +-Inf (read with memcpy: `raw` may be
// unaligned). Branch-free with independent accumulators, so that the common case (none) costs a
// fraction of the merge.
inline int64_t CountNonFinite(const char* raw, int64_t n) {
  constexpr uint64_t kExp = 0x7ff0000000000000ull;
  // Four named accumulators, not an array: GCC kept an array's in memory (a store per value).
  uint64_t k0 = 0, k1 = 0, k2 = 0, k3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    k0 += uint64_t((LoadWord(raw, i) & kExp) == kExp);
    k1 += uint64_t((LoadWord(raw, i + 1) & kExp) == kExp);
    k2 += uint64_t((LoadWord(raw, i + 2) & kExp) == kExp);
    k3 += uint64_t((LoadWord(raw, i + 3) & kExp) == kExp);
  }
  for (; i < n; ++i) k0 += uint64_t((LoadWord(raw, i) & kExp) == kExp);
  return int64_t(k0 + k1 + k2 + k3);
}

// Whether any of the `n` doubles at `raw` is NaN or +-Inf; whether any is below zero (-Inf
// included, NaN not). Without a branch per value, four independent accumulators: the common
// case (none) is a plain scan; a caller that gets true finds the first with its own loop.
inline bool AnyNonFinite(const char* raw, int64_t n) {
  constexpr uint64_t kExp = 0x7ff0000000000000ull;
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a0 |= uint64_t((LoadWord(raw, i) & kExp) == kExp);
    a1 |= uint64_t((LoadWord(raw, i + 1) & kExp) == kExp);
    a2 |= uint64_t((LoadWord(raw, i + 2) & kExp) == kExp);
    a3 |= uint64_t((LoadWord(raw, i + 3) & kExp) == kExp);
  }
  for (; i < n; ++i) a0 |= uint64_t((LoadWord(raw, i) & kExp) == kExp);
  return (a0 | a1 | a2 | a3) != 0;
}

inline bool AnyNegative(const char* raw, int64_t n) {
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a0 |= uint64_t(LoadDouble(raw, i) < 0);
    a1 |= uint64_t(LoadDouble(raw, i + 1) < 0);
    a2 |= uint64_t(LoadDouble(raw, i + 2) < 0);
    a3 |= uint64_t(LoadDouble(raw, i + 3) < 0);
  }
  for (; i < n; ++i) a0 |= uint64_t(LoadDouble(raw, i) < 0);
  return (a0 | a1 | a2 | a3) != 0;
}

// The values check every contribution passes before it is merged, on either transport: the
// first value a member may not send, among `channels` a's then `channels` b's at `raw` (read
// with memcpy: `raw` may be unaligned). With `strict`, any NaN or Inf (the job's strict mode;
// otherwise they are data and propagate); in a forward round, a negative m2 (-Inf included),
// which is never a sum of squares. Returns false with `field` (e.g. "m2[3]") and `what` (why)
// set; true when every value may be merged.
inline bool CheckContributionValues(const char* raw, int64_t channels, bool forward, bool strict,
                                    std::string* field, std::string* what) {
  const char* name_a = forward ? "mean" : "sum_dy";
  const char* name_b = forward ? "m2" : "sum_dy_xmu";
  auto at = [&](int64_t i) {
    double v;
    std::memcpy(&v, raw + i * int64_t(sizeof(double)), sizeof(double));
    return v;
  };
  auto name = [&](int64_t i) {
    return absl::StrCat(i < channels ? name_a : name_b, "[", i < channels ? i : i - channels, "]");
  };
  // The common case, every value fine, without a branch per value.
  if (!(strict && AnyNonFinite(raw, 2 * channels)) &&
      !(forward && AnyNegative(raw + channels * int64_t(sizeof(double)), channels))) {
    return true;
  }
  for (int64_t i = 0; strict && i < 2 * channels; ++i) {
    const double v = at(i);
    if (std::isfinite(v)) continue;
    *field = name(i);
    *what = absl::StrCat("is ", v, "; the local batch has NaN or Inf values (check the input "
                                   "and the learning rate). This job is strict "
                                   "(HSBN_STRICT_FINITE)");
    return false;
  }
  for (int64_t i = channels; forward && i < 2 * channels; ++i) {
    const double v = at(i);
    if (!(v < 0)) continue;
    *field = name(i);
    *what = absl::StrCat("is ", v, "; a sum of squared deviations is never negative");
    return false;
  }
  return true;
}

// ReduceInOrder (member i's count is `count_of(i)`, its arrays `get`'s) with the checks that
// only the whole round can make: the counts' sum must fit
// in int64 (CountsOverflow, naming each member by `name(i)`), and in a strict job the result
// must be finite (MergedNonFinite). `ref` is built only on failure. On success *count is the
// total count; on failure *fault says which check failed (for metrics: callers branch on it,
// never on the text).
enum class ReduceFault { kNone, kCountOverflow, kMergedNonFinite };
template <typename CountOf, typename Get, typename Name, typename Ref>
absl::Status ReduceRound(bool forward, int64_t channels, int n, CountOf count_of, Get get,
                         Name name,
                         bool strict_finite, Ref ref, double* a, double* b, int64_t* count,
                         ReduceFault* fault) {
  *fault = ReduceFault::kNone;
  int64_t total = 0;
  for (int i = 0; i < n; ++i) {
    if (__builtin_add_overflow(total, count_of(i), &total)) {
      std::vector<std::string> who;
      for (int q = 0; q < n; ++q) who.push_back(absl::StrCat(name(q), " count=", count_of(q)));
      *fault = ReduceFault::kCountOverflow;
      return CountsOverflow(ref(), who);
    }
  }
  *count = ReduceInOrder(forward, channels, n, get, a, b);
  if (strict_finite) {
    for (int64_t c = 0; c < channels; ++c) {
      if (!std::isfinite(a[c]) || !std::isfinite(b[c])) {
        *fault = ReduceFault::kMergedNonFinite;
        return MergedNonFinite(ref());
      }
    }
  }
  return absl::OkStatus();
}

template <typename Who, typename Round>
absl::Status CheckFields(const ContributionView& c, const RoundRules& rules, Who who,
                         Round round) {
  if (c.scope != v1::SCOPE_NODE && c.scope != v1::SCOPE_GLOBAL && c.scope != v1::SCOPE_SHADOW &&
      c.scope != v1::SCOPE_RENORM && c.scope != v1::SCOPE_LAGGED &&
      !(rules.group_allowed && c.scope == v1::SCOPE_GROUP)) {
    return InvalidContribution(
        who(), round(), "scope",
        absl::StrCat("is ", c.scope,
                     rules.group_allowed
                         ? "; expected node, global, shadow, group, renorm or lagged"
                         : "; expected node, global, shadow, renorm or lagged"));
  }
  if (c.scope == v1::SCOPE_RENORM && !rules.forward) {
    return InvalidContribution(who(), round(), "scope",
                               "is renorm in a backward round; a renorm layer's backward "
                               "round is node scope");
  }
  if (c.channels < 1) {
    return InvalidContribution(
        who(), round(), "channels",
        absl::StrCat("is ", c.channels, "; a BatchNorm layer has at least 1 channel"));
  }
  if (c.channels > rules.max_channels &&
      (rules.transport_cap <= 0 || c.channels > rules.transport_cap)) {
    return TooManyChannels(who(), c.channels, round(), rules.max_channels);
  }
  if (rules.transport_cap > 0 && c.channels > rules.transport_cap) {
    return InvalidContribution(
        who(), round(), "channels",
        absl::StrCat("is ", c.channels, "; the node's segment carries 1 to ", rules.transport_cap));
  }
  if (c.count < 0) {
    return InvalidContribution(who(), round(), "count",
                               absl::StrCat("is ", c.count, "; counts are >= 0"));
  }
  return absl::OkStatus();
}

template <typename Who, typename FirstWho, typename Round>
absl::Status CheckSameRound(const ContributionView& c, int64_t first_channels,
                            int32_t first_scope, Who who, FirstWho first_who, Round round) {
  if (c.channels != first_channels) {
    return DiffersFromFirst(who(), round(), "channels", absl::StrCat(c.channels), first_who(),
                            absl::StrCat(first_channels));
  }
  if (c.scope != first_scope) {
    return DiffersFromFirst(who(), round(), "scope", ScopeWord(c.scope), first_who(),
                            ScopeWord(first_scope));
  }
  return absl::OkStatus();
}

template <typename Who, typename Round>
absl::Status CheckValues(const ContributionView& c, const RoundRules& rules, Who who,
                         Round round) {
  std::string field, what;
  if (!CheckContributionValues(c.data, c.channels, rules.forward, rules.strict_finite, &field,
                               &what)) {
    return InvalidContribution(who(), round(), field, what);
  }
  return absl::OkStatus();
}

}  // namespace hsbn::wire

#endif  // HSBN_ROUND_H_
