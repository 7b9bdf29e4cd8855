// server/metrics.h in-process: label values stay bounded and space-free whatever clients send,
// and the counters and gauges the registry code reports through (NonFinite, Refused, memory,
// limits, build info) appear with exact values in the /metrics text.
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "aggregator_process.h"
#include "gtest/gtest.h"
#include "metrics.h"
#include "version.h"

namespace hsbn::server {
namespace {

using hsbn::testing::Sample;

std::map<std::string, std::string> L(
    std::initializer_list<std::pair<const std::string, std::string>> l) {
  return std::map<std::string, std::string>(l);
}

// A state source with these jobs (one connected member each, expecting `group` members).
std::function<v1::StatusResponse()> Jobs(const std::vector<std::string>* ids, int group = 2) {
  return [ids, group] {
    v1::StatusResponse s;
    for (const std::string& id : *ids) {
      v1::JobStatus* j = s.add_jobs();
      j->set_job_id(id);
      j->set_group_size(group);
      j->set_open_rounds(1);
      j->add_members()->set_connected(true);
    }
    return s;
  };
}

TEST(MetricsLabels, MemberLabelsHaveNoSpaces) {
  EXPECT_EQ(MemberLabel("rank 3"), "rank3");
  EXPECT_EQ(MemberLabel("node 1"), "node1");
  EXPECT_EQ(MemberLabel("upstream"), "upstream");
  EXPECT_EQ(MemberLabel("rank 3\n\"x\"{}"), "rank3__x___");
  EXPECT_EQ(MemberLabel(std::string(100, 'a')).size(), 32u);

  Metrics m("node", false);
  m.RoundTimedOut("job", "rank 1");
  const std::string text = m.Text();
  EXPECT_EQ(Sample(text, "hsbn_round_timeouts_total", L({{"job_id", "job"}, {"member", "rank1"}})),
            1);
  EXPECT_EQ(text.find("rank 1"), std::string::npos) << text;
}

TEST(MetricsLabels, OnlyTheFirstMaxJobsJobsGetALabelTheRestCountAsOther) {
  Metrics m("node", false, /*max_job_labels=*/2);
  // A hostile client times out rounds in 100 jobs of its own naming.
  for (int i = 0; i < 100; ++i) m.RoundTimedOut("job" + std::to_string(i), "rank 0");
  std::string text = m.Text();
  EXPECT_EQ(Sample(text, "hsbn_round_timeouts_total", L({{"job_id", "job0"}})), 1);
  EXPECT_EQ(Sample(text, "hsbn_round_timeouts_total", L({{"job_id", "job1"}})), 1);
  EXPECT_EQ(Sample(text, "hsbn_round_timeouts_total", L({{"job_id", "_other"}})), 98);
  EXPECT_TRUE(std::isnan(Sample(text, "hsbn_round_timeouts_total", L({{"job_id", "job2"}}))));

  // State gauges: job0 and job1 hold the labels while they exist; job7 and job8 sum to _other.
  std::vector<std::string> ids = {"job0", "job1", "job7", "job8"};
  m.SetStateSource(Jobs(&ids));
  text = m.Text();
  EXPECT_EQ(Sample(text, "hsbn_jobs"), 4);
  EXPECT_EQ(Sample(text, "hsbn_open_rounds", L({{"job_id", "job0"}})), 1);
  EXPECT_EQ(Sample(text, "hsbn_members_expected", L({{"job_id", "job1"}})), 2);
  EXPECT_EQ(Sample(text, "hsbn_open_rounds", L({{"job_id", "_other"}})), 2);
  EXPECT_EQ(Sample(text, "hsbn_members", L({{"job_id", "_other"}})), 2);
  EXPECT_EQ(Sample(text, "hsbn_members_expected", L({{"job_id", "_other"}})), 4);
  EXPECT_TRUE(std::isnan(Sample(text, "hsbn_open_rounds", L({{"job_id", "job7"}}))));

  // job0 is gone: the next scrape releases its label and its counters; job7 takes the label.
  ids = {"job1", "job7", "job8"};
  text = m.Text();
  EXPECT_TRUE(std::isnan(Sample(text, "hsbn_round_timeouts_total", L({{"job_id", "job0"}}))));
  EXPECT_EQ(Sample(text, "hsbn_open_rounds", L({{"job_id", "job7"}})), 1);
  EXPECT_EQ(Sample(text, "hsbn_open_rounds", L({{"job_id", "_other"}})), 1);
  m.RoundTimedOut("job7", "rank 1");
  text = m.Text();
  EXPECT_EQ(Sample(text, "hsbn_round_timeouts_total", L({{"job_id", "job7"}, {"member", "rank1"}})),
            1);
  m.SetStateSource(nullptr);
}

TEST(MetricsLabels, AJobNamedOtherDoesNotTakeALabel) {
  Metrics m("node", false, 1);
  m.RoundTimedOut("_other", "rank 0");
  m.RoundTimedOut("real", "rank 0");
  const std::string text = m.Text();
  EXPECT_EQ(Sample(text, "hsbn_round_timeouts_total", L({{"job_id", "real"}})), 1);
  EXPECT_EQ(Sample(text, "hsbn_round_timeouts_total", L({{"job_id", "_other"}})), 1);
}

TEST(MetricsCounters, NonFiniteValuesAreCountedByPhase) {
  Metrics m("root", false);
  std::string text = m.Text();
  EXPECT_EQ(Sample(text, "hsbn_nonfinite_values_total", L({{"phase", "forward"}})), 0);
  EXPECT_EQ(Sample(text, "hsbn_nonfinite_values_total", L({{"phase", "backward"}})), 0);
  m.NonFinite(v1::PHASE_FORWARD, 3);
  m.NonFinite(v1::PHASE_BACKWARD, 5);
  m.NonFinite(v1::PHASE_BACKWARD, 2);
  m.NonFinite(v1::PHASE_FORWARD, 0);
  text = m.Text();
  EXPECT_EQ(Sample(text, "hsbn_nonfinite_values_total",
                   L({{"role", "root"}, {"phase", "forward"}})), 3);
  EXPECT_EQ(Sample(text, "hsbn_nonfinite_values_total", L({{"phase", "backward"}})), 7);
}

TEST(MetricsCounters, RefusalsAreCountedByAFixedSetOfReasons) {
  Metrics m("node", false);
  std::string text = m.Text();
  for (const char* reason : Metrics::kRefusedReasons) {
    EXPECT_EQ(Sample(text, "hsbn_refused_total", L({{"reason", reason}})), 0) << reason;
  }
  m.Refused("memory_budget");
  m.Refused("memory_budget");
  m.Refused("strict_nonfinite");
  m.Refused("a reason a caller made up");
  m.Refused(nullptr);
  text = m.Text();
  EXPECT_EQ(Sample(text, "hsbn_refused_total", L({{"reason", "memory_budget"}})), 2);
  EXPECT_EQ(Sample(text, "hsbn_refused_total", L({{"reason", "strict_nonfinite"}})), 1);
  EXPECT_EQ(Sample(text, "hsbn_refused_total", L({{"reason", "other"}})), 2);
  EXPECT_EQ(text.find("made up"), std::string::npos);
}

TEST(MetricsGauges, LaggedTripsPerJobAndOp) {
  Metrics m("node", false);
  m.SetStateSource([] {
    v1::StatusResponse s;
    v1::JobStatus* j = s.add_jobs();
    j->set_job_id("t-job");
    v1::LaggedTripStatus* t = j->add_lagged_trips();
    t->set_op(7);
    t->set_trips(3);
    t->set_last_drift(2.5);
    return s;
  });
  const std::string text = m.Text();
  EXPECT_EQ(Sample(text, "hsbn_lagged_trips", L({{"job_id", "t-job"}, {"op", "7"}})), 3);
  EXPECT_EQ(Sample(text, "hsbn_lagged_trip_drift", L({{"job_id", "t-job"}, {"op", "7"}})), 2.5);
}

TEST(MetricsGauges, MemoryLimitsAndBuildInfo) {
  Metrics m("node", false);
  MetricsLimits limits;
  limits.max_jobs = 5;
  limits.max_open_rounds = 6;
  limits.max_channels = 7;
  limits.max_world_size = 8;
  limits.memory_budget_bytes = int64_t(3) << 30;
  limits.max_queued_bytes = 10;
  limits.max_unbound_bytes = 11;
  m.SetLimits(limits);
  m.SetMemoryUsed(12345);
  const std::string text = m.Text();
  EXPECT_EQ(Sample(text, "hsbn_memory_used_bytes"), 12345);
  EXPECT_EQ(Sample(text, "hsbn_memory_budget_bytes"), double(int64_t(3) << 30));
  EXPECT_EQ(Sample(text, "hsbn_max_jobs"), 5);
  EXPECT_EQ(Sample(text, "hsbn_max_open_rounds"), 6);
  EXPECT_EQ(Sample(text, "hsbn_max_channels"), 7);
  EXPECT_EQ(Sample(text, "hsbn_max_world_size"), 8);
  EXPECT_EQ(Sample(text, "hsbn_max_queued_bytes"), 10);
  EXPECT_EQ(Sample(text, "hsbn_max_unbound_bytes"), 11);
  EXPECT_EQ(Sample(text, "hsbn_build_info",
                   L({{"role", "node"}, {"version", kHsbnVersion}, {"commit", kHsbnGitCommit}})),
            1);
  EXPECT_NE(std::string(kHsbnVersion), "");
}

}  // namespace
}  // namespace hsbn::server
