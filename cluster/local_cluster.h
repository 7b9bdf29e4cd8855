// cluster/local_cluster.h — an hsbn topology of real processes on one machine.
//
// LocalCluster starts a root aggregator (when there is more than one node), optionally one
// group aggregator per group of nodes (group_tier), and one sidecar per simulated node, each a
// separate hsbn-aggregator process, waits until each is listening, and
// tells a worker process what environment it needs. The integration tests, the synthetic main
// job and the benchmarks use it; hsbn.cluster.LocalCluster is its Python twin.
//
// Subprocess is a child process with its output sent to a log file.
//
// Thread safety: none; use from one thread.
#ifndef HSBN_CLUSTER_LOCAL_CLUSTER_H_
#define HSBN_CLUSTER_LOCAL_CLUSTER_H_

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hsbn::cluster {

class Subprocess {
 public:
  // Starts argv[0] with argv, the current environment plus `env`, stdout and stderr appended to
  // `log_path` ("" keeps the parent's).
  static absl::StatusOr<std::unique_ptr<Subprocess>> Spawn(
      const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
      const std::string& log_path);
  ~Subprocess();  // SIGKILLs the process if it still runs

  pid_t pid() const { return pid_; }
  bool Running();
  // Sends `sig`; for SIGSTOP, returns once the process has stopped.
  void Signal(int sig);
  // Waits up to `timeout` for the exit; returns the exit code (128+signal if killed), or -1
  // if it still runs.
  int Wait(std::chrono::milliseconds timeout);
  // SIGTERM, then SIGKILL after `grace`; returns the exit code.
  int Stop(std::chrono::milliseconds grace = std::chrono::seconds(5));
  const std::string& log_path() const { return log_path_; }

 private:
  Subprocess(pid_t pid, std::string log) : pid_(pid), log_path_(std::move(log)) {}
  pid_t pid_;
  std::string log_path_;
  bool exited_ = false;
  int code_ = -1;
};

struct ClusterOptions {
  int nodes = 2;
  int workers_per_node = 4;
  std::string aggregator;  // path of hsbn-aggregator; "" = $HSBN_AGGREGATOR or the build's
  std::string dir;         // sockets, ready files, logs; "" = a new temporary directory
  std::vector<std::string> extra_flags;  // given to every aggregator
  std::vector<std::string> root_flags;   // given to the root only (root-only flags)
  bool root = true;        // start a root when nodes > 1
  // Simulated cross-node link: with link_proxy (or a link_delay_ms > 0) every sidecar reaches
  // the root through its own hsbn-linkproxy, which holds each chunk link_delay_ms in each
  // direction; LinkCommand() cuts, stalls or re-delays one node's link. Node rounds never
  // cross it, global and shadow rounds cross it twice (partial up, result down).
  bool link_proxy = false;
  int link_delay_ms = 0;
  std::string linkproxy;   // path of hsbn-linkproxy; "" = $HSBN_LINKPROXY or the build's
  // Group tier: one group aggregator (--role=group) per `group_nodes` consecutive nodes, between
  // their sidecars and the root; WorkerEnv sets HSBN_GROUP_NODES. With link_proxy, each node's
  // sidecar reaches its group aggregator through a proxy delaying group_link_delay_us each way,
  // and each group aggregator reaches the root through one delaying link_delay_us (or
  // link_delay_ms) each way. Without a tier, link_delay_us is the sidecar <-> root delay.
  bool group_tier = false;
  int group_nodes = 0;              // HSBN_GROUP_NODES: 0 = none
  int64_t link_delay_us = -1;       // -1: link_delay_ms * 1000
  int64_t group_link_delay_us = 0;
  std::vector<std::string> group_flags;  // given to the group aggregators only
};

class LocalCluster {
 public:
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(ClusterOptions options);
  ~LocalCluster();  // stops everything and removes a temporary directory it made

  int nodes() const { return options_.nodes; }
  int workers_per_node() const { return options_.workers_per_node; }
  int world_size() const { return options_.nodes * options_.workers_per_node; }
  const std::string& dir() const { return options_.dir; }
  std::string sidecar_address(int node) const;
  const std::string& root_address() const { return root_address_; }
  Subprocess* sidecar(int node) { return sidecars_.at(node).get(); }
  Subprocess* root() { return root_.get(); }
  // The group tier (empty without one): group g serves nodes [g*K, g*K+K).
  int groups() const { return int(groups_.size()); }
  Subprocess* group(int g) { return groups_.at(g).get(); }
  const std::string& group_address(int g) const { return group_addresses_.at(g); }
  // The node's link proxy, or nullptr when the cluster has none.
  Subprocess* link_proxy(int node) {
    return proxies_.empty() ? nullptr : proxies_.at(node).get();
  }
  // Sends one command line to node `node`'s link proxy (see `hsbn-linkproxy --help`: drop,
  // reset, stall, resume, delay UP [DOWN], stats) and returns its answer line without "ok ";
  // an "error ..." answer is INVALID_ARGUMENT.
  absl::StatusOr<std::string> LinkCommand(int node, const std::string& command);

  // RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, HSBN_JOB_ID, HSBN_ADDRESS.
  std::map<std::string, std::string> WorkerEnv(int rank, const std::string& job_id) const;

  // Stops (SIGTERM) and starts a node's sidecar again on the same address.
  absl::Status RestartSidecar(int node);
  absl::Status RestartRoot();
  // Stops (SIGTERM) and starts group g's aggregator again on the same address.
  absl::Status RestartGroup(int g);
  // Stops everything now (also done by the destructor).
  void Stop();

  // The aggregator binary this cluster runs.
  static std::string DefaultAggregatorPath();
  // The link proxy it runs when asked for one.
  static std::string DefaultLinkProxyPath();

 private:
  explicit LocalCluster(ClusterOptions options) : options_(std::move(options)) {}
  absl::StatusOr<std::unique_ptr<Subprocess>> StartAggregator(const std::string& name,
                                                              std::vector<std::string> flags,
                                                              std::string* bound);
  absl::Status StartSidecar(int node);
  absl::Status StartGroup(int g, const std::string& listen);
  // A proxy named `name` to `target`, delaying `delay_us` each way; returns its address.
  absl::StatusOr<std::string> StartLinkProxy(const std::string& name, const std::string& target,
                                             int64_t delay_us,
                                             std::unique_ptr<Subprocess>* out);
  // Waits for a ready file naming the bound address (written by aggregators and proxies).
  absl::StatusOr<std::string> WaitReady(const std::string& name, const std::string& ready,
                                        Subprocess* p);

  ClusterOptions options_;
  bool own_dir_ = false;
  std::string root_address_;
  std::unique_ptr<Subprocess> root_;
  std::vector<std::unique_ptr<Subprocess>> sidecars_;
  std::vector<std::unique_ptr<Subprocess>> proxies_;  // one per node, or none
  std::vector<std::string> proxy_addresses_;
  std::vector<std::unique_ptr<Subprocess>> groups_;   // the group tier, or none
  std::vector<std::string> group_addresses_;
  std::vector<std::unique_ptr<Subprocess>> group_proxies_;  // group -> root links, or none
  std::vector<std::string> group_proxy_addresses_;
};

}  // namespace hsbn::cluster

#endif  // HSBN_CLUSTER_LOCAL_CLUSTER_H_
