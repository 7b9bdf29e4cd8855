// Job's shadow records (how far each node's or group's statistics are from the job's) and auto
// scope's decisions from them (job.h; docs/PROTOCOL.md, "Shadow scope", "Auto scope").
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "job.h"
#include "wire.h"

namespace hsbn::server {

void Job::DivergenceAcc::Add(int64_t channels, int64_t count, const double* nm,
                             const double* nm2, int64_t global_count, const double* gm,
                             const double* gm2) {
  double shift_sum = 0, shift_max = 0, ratio_sum = 0, log_sum = 0;
  for (int64_t c = 0; c < channels; ++c) {
    const double gvar = gm2[c] / double(global_count);
    const double nvar = nm2[c] / double(count);
    const double shift = std::fabs(nm[c] - gm[c]) / std::sqrt(gvar + 1e-5);
    const double ratio = (nvar + 1e-5) / (gvar + 1e-5);
    shift_sum += shift;
    shift_max = std::max(shift_max, shift);
    ratio_sum += ratio;
    log_sum += std::fabs(std::log(ratio));
  }
  rounds += 1;
  mean_shift_sum += shift_sum / double(channels);
  mean_shift_max = std::max(mean_shift_max, shift_max);
  var_ratio_sum += ratio_sum / double(channels);
  log_var_ratio_abs_sum += log_sum / double(channels);
}

// What one shadow record costs against the memory budget: the map node and its accumulator.
constexpr int64_t kRecordBytes = 128;

Job::DivergenceAcc* Job::RecordLocked(Records& records, std::pair<uint32_t, int32_t> key,
                                      Actions* out) {
  auto it = records.find(key);
  if (it != records.end()) return &it->second;
  if (limits_.budget &&
      !limits_.budget->TryChargeWithin(kRecordBytes, limits_.budget->limit() / 4)) {
    if (records_refused_++ == 0) {
      out->log.push_back(absl::StrCat(
          "job '", id_, "': shadow records now take a quarter of --memory-budget-bytes; ",
          "rounds of further layers go unrecorded (their auto decisions are global)"));
    }
    return nullptr;
  }
  held_ += kRecordBytes;
  return &records[key];
}

void Job::RecordDivergenceLocked(const Round& round, const v1::Result& global, Actions* out) {
  const int64_t channels = round.channels;
  std::vector<double> gm(channels), gm2(channels), nm(channels), nm2(channels);
  wire::UnpackPayload(global.data(), channels, gm.data(), gm2.data());
  if (global.count() == 0) return;
  const uint32_t op = round.key.op;
  const int32_t k = layout_.group_nodes;
  std::vector<double> sm(channels), sm2(channels);
  int64_t group_count = 0;
  // Members are nodes first_node(), first_node() + 1, ...; or, at a root above group
  // aggregators, whole groups (whose nodes each group aggregator records).
  const int32_t span = std::max(1, layout_.member_nodes);
  const int32_t first = layout_.first_node();
  for (size_t i = 0; i < round.slots.size(); ++i) {
    const Slot& slot = round.slots[i];
    if (span > 1) {  // the Registry admits such members only with groups of `span` nodes
      if (slot.count == 0 || k <= 0) continue;
      wire::UnpackPayload(slot.data, channels, nm.data(), nm2.data());
      const int32_t group = (first + int32_t(i) * span) / k;
      for (Records* records : {&group_divergence_, &decide_window_}) {
        if (DivergenceAcc* r = RecordLocked(*records, {op, group}, out)) {
          r->Add(channels, slot.count, nm.data(), nm2.data(), global.count(), gm.data(),
                 gm2.data());
        }
      }
      continue;
    }
    const int32_t node = first + int32_t(i);
    if (k > 0 && node % k == 0) {
      group_count = 0;
      std::fill(sm.begin(), sm.end(), 0.0);
      std::fill(sm2.begin(), sm2.end(), 0.0);
    }
    if (slot.count > 0) {
      wire::UnpackPayload(slot.data, channels, nm.data(), nm2.data());
      if (DivergenceAcc* r = RecordLocked(divergence_, {op, node}, out)) {
        r->Add(channels, slot.count, nm.data(), nm2.data(), global.count(), gm.data(),
               gm2.data());
      }
      if (k == 0) {
        if (DivergenceAcc* r = RecordLocked(decide_window_, {op, node}, out)) {
          r->Add(channels, slot.count, nm.data(), nm2.data(), global.count(), gm.data(),
                 gm2.data());
        }
      } else {
        // The group's statistics, merged in node order as its group rounds are.
        group_count = MergeChannelMoments(group_count, sm.data(), sm2.data(), slot.count,
                                          nm.data(), nm2.data(), channels);
      }
    }
    if (k > 0 && node % k == k - 1 && group_count > 0) {
      const int32_t group = node / k;
      for (Records* records : {&group_divergence_, &decide_window_}) {
        if (DivergenceAcc* r = RecordLocked(*records, {op, group}, out)) {
          r->Add(channels, group_count, sm.data(), sm2.data(), global.count(), gm.data(),
                 gm2.data());
        }
      }
    }
  }
}

v1::AutoDecision Job::DecideLocked(uint32_t op, const v1::AutoDecide& request) {
  const int32_t units = layout_.group_nodes > 0 ? layout_.num_nodes / layout_.group_nodes
                                                : layout_.num_nodes;
  v1::AutoDecision d;
  int64_t fewest = std::numeric_limits<int64_t>::max();
  double shift = 0, log_ratio = 0;
  for (int32_t u = 0; u < units; ++u) {
    auto it = decide_window_.find({op, u});
    const int64_t rounds = it == decide_window_.end() ? 0 : it->second.rounds;
    fewest = std::min(fewest, rounds);
    if (rounds == 0) continue;
    shift = std::max(shift, it->second.mean_shift_sum / double(rounds));
    log_ratio = std::max(log_ratio, it->second.log_var_ratio_abs_sum / double(rounds));
    decide_window_.erase(it);
    ReleaseLocked(kRecordBytes);
  }
  d.set_mean_shift(shift);
  d.set_log_var_ratio(log_ratio);
  d.set_rounds(fewest == std::numeric_limits<int64_t>::max() ? 0 : fewest);
  // No record for some node or group (its shadow partials were lost): the safe choice, global.
  const bool cheap = fewest > 0 && fewest != std::numeric_limits<int64_t>::max() &&
                     shift <= request.max_mean_shift() && log_ratio <= request.max_log_var_ratio();
  d.set_scope(!cheap ? v1::SCOPE_GLOBAL
                     : layout_.group_nodes > 0 ? v1::SCOPE_GROUP : v1::SCOPE_NODE);
  return d;
}

}  // namespace hsbn::server
