/* hsbn.h — the C ABI of the hsbn client library (libhsbn.so).
 *
 * A small, stable C interface over hsbn::Client, so that Python (ctypes) and other frameworks
 * bind without depending on one compiler's or one PyTorch version's C++ ABI. It follows NCCL's
 * shape: opaque handles, integer result codes, a string for each code, configuration through
 * documented HSBN_* environment variables.
 *
 * Result codes are the gRPC / absl status code numbers. When a call fails, hsbn_last_error()
 * returns a message that says what went wrong and what to do; it is per thread and stays valid
 * until the next hsbn call on that thread.
 *
 * Thread safety: one hsbn_client may be used from several threads at once; rounds on it are
 * matched by key, not by order. An hsbn_round belongs to the thread that waits on it.
 *
 * Arrays: every statistics array holds `channels` doubles, in host memory.
 */
#ifndef HSBN_H_
#define HSBN_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HSBN_ABI_VERSION 6

typedef enum hsbn_result {
  HSBN_OK = 0,
  HSBN_CANCELLED = 1,
  HSBN_UNKNOWN = 2,
  HSBN_INVALID_ARGUMENT = 3,
  HSBN_DEADLINE_EXCEEDED = 4,
  HSBN_NOT_FOUND = 5,
  HSBN_ALREADY_EXISTS = 6,
  HSBN_PERMISSION_DENIED = 7,
  HSBN_RESOURCE_EXHAUSTED = 8,
  HSBN_FAILED_PRECONDITION = 9,
  HSBN_ABORTED = 10,
  HSBN_OUT_OF_RANGE = 11,
  HSBN_UNIMPLEMENTED = 12,
  HSBN_INTERNAL = 13,
  HSBN_UNAVAILABLE = 14,
  HSBN_DATA_LOSS = 15,
  HSBN_UNAUTHENTICATED = 16
} hsbn_result;

/* Why a call failed, beside its code (hsbn_last_error_reason): programs branch on the code and
 * this, never on the message's text. The numbers are the protocol's (hsbn.v1.Reason); values may
 * be added, and one a program does not know means "not said". */
typedef enum hsbn_reason {
  HSBN_REASON_UNSPECIFIED = 0,          /* not said */
  HSBN_REASON_MEMBER_DISCONNECTED = 1,  /* a member's stream broke while the round waited */
  HSBN_REASON_MEMBER_LEFT = 2,          /* a member left the job while the round waited */
  HSBN_REASON_MEMBER_ABORTED = 3,       /* a member aborted (hsbn_client_abort), with a reason */
  HSBN_REASON_NODE_DOWN = 4,            /* another node lost a worker */
  HSBN_REASON_TIMED_OUT = 5,            /* members did not contribute before the deadline */
  HSBN_REASON_ROOT_SILENT = 6,          /* the root did not answer a forwarded round in time */
  HSBN_REASON_INVALID_CONTRIBUTION = 7, /* a malformed or inconsistent contribution */
  HSBN_REASON_COUNT_OVERFLOW = 8,       /* the members' counts overflow int64 */
  HSBN_REASON_NONFINITE = 9,            /* a strict job's round has NaN or Inf */
  HSBN_REASON_LAYOUT = 10,              /* an inconsistent RANK, WORLD_SIZE, ... */
  HSBN_REASON_GROUP_NODES = 11,         /* HSBN_GROUP_NODES does not divide the nodes */
  HSBN_REASON_MAX_WORLD_SIZE = 12,      /* WORLD_SIZE above the aggregator's --max-world-size */
  HSBN_REASON_MAX_JOBS = 13,            /* the aggregator serves --max-jobs jobs already */
  HSBN_REASON_JOB_ID = 14,              /* an empty, too long or unprintable job id */
  HSBN_REASON_QUEUE_BYTES = 15,         /* the stream's reader fell --max-queued-bytes behind */
  HSBN_REASON_MEMORY_BUDGET = 16,       /* the aggregator's memory budget is exhausted */
  HSBN_REASON_CLIENT_ABORTED = 17,      /* this client was aborted (hsbn_client_abort) */
  HSBN_REASON_SHUTTING_DOWN = 18        /* the sidecar, group aggregator or root is stopping
                                           (SIGTERM, SIGINT): restart the job */
} hsbn_reason;

typedef enum hsbn_scope {
  HSBN_SCOPE_NODE = 1,
  HSBN_SCOPE_GLOBAL = 2,
  HSBN_SCOPE_SHADOW = 3,
  HSBN_SCOPE_GROUP = 4,  /* the node's group of hsbn_options.group_nodes consecutive nodes */
  HSBN_SCOPE_AUTO = 5,   /* shadow for a warm-up, then node (group) or global, decided per op by
                            the root (hsbn_set_auto_policy, hsbn_get_auto_decision) */
  HSBN_SCOPE_RENORM = 6, /* forward: answered with the node's statistics at once; the job's
                            statistics follow (hsbn_client_global_stats). Backward: node */
  HSBN_SCOPE_LAGGED = 7  /* (ABI 4) forward and backward: answered with the node's statistics
                            (sums) at once; the job's follow (hsbn_client_global_stats,
                            hsbn_client_global_sums). A backward's sum_dy_xmu is around the mean
                            of its forward round's node answer */
} hsbn_scope;

typedef enum hsbn_phase {
  HSBN_PHASE_FORWARD = 1,  /* a = mean, b = m2; reduced with Chan's merge */
  HSBN_PHASE_BACKWARD = 2  /* a = sum_dy, b = sum_dy_xmu; reduced by summation */
} hsbn_phase;

typedef struct hsbn_client hsbn_client;
typedef struct hsbn_round hsbn_round;

/* Connection options. Initialise with hsbn_options_init(), then set fields. */
typedef struct hsbn_options {
  size_t struct_size;          /* sizeof(hsbn_options); set by hsbn_options_init */
  const char* address;         /* "unix:/path/to.sock" or "host:port" of the node's sidecar */
  const char* job_id;          /* any non-empty string shared by the job's workers */
  int32_t rank;                /* RANK */
  int32_t world_size;          /* WORLD_SIZE */
  int32_t local_rank;          /* LOCAL_RANK */
  int32_t local_world_size;    /* LOCAL_WORLD_SIZE */
  int32_t node_rank;           /* GROUP_RANK */
  int64_t round_timeout_ms;    /* how long a round call waits; 0: the aggregator's timeout + 5 s */
  int64_t connect_timeout_ms;  /* how long to wait for the sidecar; 0: 10 s */
  const char* token;           /* job token, or NULL for none */
  int32_t strict_finite;       /* 1: the job's strict mode (NaN/Inf fail rounds); 0: data;
                                  -1 (hsbn_options_init): HSBN_STRICT_FINITE */
  int32_t group_nodes;         /* nodes per group for HSBN_SCOPE_GROUP; 0: none; -1 (init):
                                  HSBN_GROUP_NODES. Must divide the number of nodes; the same
                                  everywhere */
  /* The fields below set what the environment sets otherwise; each "unset" value (what
   * hsbn_options_init writes) takes the variable's value from `env`, or from the process's
   * environment when `env` is NULL (docs/ENVIRONMENT.md: one table parses them everywhere). */
  const char* const* env;      /* NULL, or "NAME=VALUE" entries, NULL-terminated */
  const char* transport;       /* "auto" or "grpc"; NULL: HSBN_TRANSPORT */
  int64_t incarnation;         /* the job's run number, >= 0; -1: HSBN_INCARNATION */
  int64_t auto_warmup;         /* >= 1; -1: HSBN_AUTO_WARMUP */
  double auto_max_mean_shift;  /* >= 0; -1: HSBN_AUTO_MAX_MEAN_SHIFT */
  double auto_max_log_var_ratio; /* >= 0; -1: HSBN_AUTO_MAX_LOG_VAR_RATIO */
  int64_t auto_recheck_every;  /* >= 0; -1: HSBN_AUTO_RECHECK_EVERY */
} hsbn_options;

typedef struct hsbn_client_info {
  int32_t rank;
  int32_t world_size;
  int32_t local_rank;
  int32_t local_world_size;
  int32_t node_rank;
  int32_t num_nodes;
  int32_t max_channels;        /* the aggregator's limit */
  int64_t round_timeout_ms;    /* the aggregator's round timeout */
} hsbn_client_info;

/* Round statistics (hsbn_client_stats): counters of one scope and phase. */
typedef struct hsbn_round_stats {
  int64_t completed;           /* rounds whose result arrived (the call returned HSBN_OK) */
  int64_t failed;              /* rounds whose start, wait, forward or backward call failed */
  /* Wall time callers spent blocked on these rounds (completed and failed), in seconds: the
   * whole call for hsbn_forward / hsbn_backward, the time inside hsbn_round_wait for
   * asynchronous rounds (hsbn_round_start itself is not counted). Threads waiting at the same
   * time each count their own wait. */
  double blocked_seconds;
  double max_blocked_seconds;  /* the longest single blocked call */
} hsbn_round_stats;

/* What a client did since it was created or since hsbn_client_reset_stats. A round is counted
 * once, under the scope and phase it was started with, when its wait (or its blocking call)
 * returns, or when its start fails; calls refused for an invalid scope or phase are not
 * counted. There is no local scope at this level: a local BatchNorm layer makes no rounds.
 *
 * Versioned by size: set struct_size = sizeof(hsbn_stats) before the call. The library fills
 * at most struct_size bytes (fields it does not know stay as they were) and sets struct_size
 * to the number of bytes it filled; fields may be added at the end in later versions. */
typedef struct hsbn_stats {
  size_t struct_size;
  hsbn_round_stats rounds[3][2];  /* [scope - 1][phase - 1], e.g. rounds[HSBN_SCOPE_GLOBAL - 1]
                                     [HSBN_PHASE_BACKWARD - 1] */
  int64_t bytes_sent;             /* serialized bytes of the frames written to the round stream */
  int64_t bytes_received;         /* ... and read from it (gRPC / HTTP/2 framing not included) */
  double elapsed_seconds;         /* wall time since creation or the last reset */
  hsbn_round_stats group_rounds[2];  /* HSBN_SCOPE_GROUP's, [phase - 1] (auto-scope rounds
                                        count under the scope they were sent with) */
  /* Added after group_rounds: how the node's rounds travel, NUL-terminated: "shm",
   * "grpc: <why>" or "pending" (until the sidecar heard from every local rank); cut to fit. */
  char transport[256];
  /* Added after transport (ABI 3): HSBN_SCOPE_RENORM's rounds, [phase - 1]; the
   * hsbn_client_global_stats calls (completed, failed, blocked time) and how many of them had
   * to wait for the result. */
  hsbn_round_stats renorm_rounds[2];
  hsbn_round_stats global_stats;
  int64_t global_stats_waited;
  /* Added after global_stats_waited (ABI 4): HSBN_SCOPE_LAGGED's rounds, [phase - 1]
   * (global_stats counts hsbn_client_global_sums calls too); late results the sidecar sent for
   * rounds this client did not start with renorm or lagged scope, dropped. */
  hsbn_round_stats lagged_rounds[2];
  int64_t late_dropped;
} hsbn_stats;

/* Name of a result code ("INVALID_ARGUMENT"); never NULL. */
const char* hsbn_result_string(hsbn_result code);
/* Message of the last failed hsbn call on this thread ("" if none); never NULL. */
const char* hsbn_last_error(void);
/* The hsbn_reason of the last failed hsbn call on this thread (HSBN_REASON_UNSPECIFIED if none
 * or not said). */
int hsbn_last_error_reason(void);
/* Name of a reason ("MEMBER_ABORTED"; "UNSPECIFIED" for 0 and unknown values); never NULL. */
const char* hsbn_reason_string(int reason);
/* The value of environment variable `name` (one of docs/ENVIRONMENT.md's) as hsbn reads it:
 * checked against its type and range, written canonically (integers in decimal, flags 0/1),
 * with its fallback (HSBN_JOB_ID: TORCHELASTIC_RUN_ID; HSBN_TOKEN: the contents of
 * HSBN_TOKEN_FILE; HSBN_INCARNATION: TORCHELASTIC_RESTART_COUNT) or its default when unset,
 * "" when it has none. `env`: NULL for the process's environment, or "NAME=VALUE" entries,
 * NULL-terminated. Writes it NUL-terminated into buf (cut to buf_len) and its full size + 1
 * into *needed. HSBN_INVALID_ARGUMENT naming the variable for a bad value or an unset required
 * one; HSBN_NOT_FOUND for a name that is not in the table. */
hsbn_result hsbn_env_get(const char* const* env, const char* name, char* buf, size_t buf_len,
                         size_t* needed);
/* HSBN_OK if `address` is an aggregator address a client can connect to (unix:PATH, HOST:PORT,
 * gRPC's dns:/ipv4:/ipv6:/unix-abstract: targets); else HSBN_INVALID_ARGUMENT with
 * hsbn_last_error() saying why, naming it as `label` (e.g. "--address" or "HSBN_ADDRESS"). */
hsbn_result hsbn_check_address(const char* address, const char* label);
/* The table of variables: the name of entry i (0, 1, ...), or NULL past the end. */
const char* hsbn_env_name(int i);
/* The table as Markdown (docs/ENVIRONMENT.md), written as hsbn_env_get writes. */
hsbn_result hsbn_env_markdown(char* buf, size_t buf_len, size_t* needed);

/* HSBN_ABI_VERSION of the loaded library. */
int hsbn_abi_version(void);

/* (ABI 5) The scope table: every hsbn_scope value, 1 to hsbn_scope_count(), with its name and
 * properties, from the one C++ table (proto/wire.h, kScopes) the library itself branches on. */
enum {
  HSBN_SCOPE_CROSS_NODE = 1,    /* some round of it waits on other nodes */
  HSBN_SCOPE_ROUND_STATS = 2,   /* counted under its own name in hsbn_stats (not auto's) */
  HSBN_SCOPE_ON_WIRE = 4,       /* its rounds carry it (auto's go as the scope it uses) */
  HSBN_SCOPE_LATE = 8,          /* forward answered with the node's statistics; the job's follow
                                   (hsbn_client_global_stats) */
  HSBN_SCOPE_LATE_BACKWARD = 16 /* its backward too (hsbn_client_global_sums) */
};
int hsbn_scope_count(void);
/* The name of `scope` ("node", "global", ...), or NULL for a value that is no scope. */
const char* hsbn_scope_name(int scope);
/* The HSBN_SCOPE_* flags of `scope` OR-ed, or -1 for a value that is no scope. */
int hsbn_scope_flags(int scope);

void hsbn_options_init(hsbn_options* options);

/* Checks a worker's layout as torchrun names it (RANK, WORLD_SIZE, LOCAL_RANK,
 * LOCAL_WORLD_SIZE, GROUP_RANK): LOCAL_WORLD_SIZE workers on every node, ranked node by node.
 * HSBN_OK, or HSBN_INVALID_ARGUMENT with hsbn_last_error() naming the variable to fix. The same
 * check the client and the aggregator apply. */
hsbn_result hsbn_check_layout(int64_t rank, int64_t world_size, int64_t local_rank,
                              int64_t local_world_size, int64_t node_rank);
/* The same with K nodes per group (group scope): K = 0 (none) or a divisor of the number of
 * nodes, else HSBN_INVALID_ARGUMENT naming both numbers. */
hsbn_result hsbn_check_layout_groups(int64_t rank, int64_t world_size, int64_t local_rank,
                                     int64_t local_world_size, int64_t node_rank,
                                     int64_t group_nodes);

/* Joins the job at the sidecar and opens the round stream. */
hsbn_result hsbn_client_create(const hsbn_options* options, hsbn_client** out);
/* Same, from RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, HSBN_JOB_ID,
 * HSBN_ADDRESS (default unix:/tmp/hsbn.sock), HSBN_ROUND_TIMEOUT_MS, HSBN_TOKEN / HSBN_TOKEN_FILE.
 * Both honour HSBN_STRICT_FINITE=1 (the job's strict mode: NaN/Inf fail rounds; docs/PROTOCOL.md)
 * and HSBN_DEBUG=INFO (what the client does, one line each on stderr). */
hsbn_result hsbn_client_create_from_env(hsbn_client** out);
/* Leaves the job and closes the stream. NULL is ignored. */
void hsbn_client_destroy(hsbn_client* client);
hsbn_result hsbn_client_get_info(const hsbn_client* client, hsbn_client_info* out);

/* One forward round, blocking: contributes this worker's (count, mean, m2) and receives the
 * reduced (count, mean, m2) of the scope. Outputs may alias inputs. */
hsbn_result hsbn_forward(hsbn_client* client, uint32_t op, uint64_t seq, hsbn_scope scope,
                         int64_t channels, int64_t count, const double* mean, const double* m2,
                         int64_t* out_count, double* out_mean, double* out_m2);

/* Renorm and lagged scope: the job's (global) count, mean[channels] and m2[channels] of forward
 * round (op, seq), started with HSBN_SCOPE_RENORM or HSBN_SCOPE_LAGGED on this client. Blocks until they arrive (every
 * worker of the job gets the same bits), at most the round timeout: DEADLINE_EXCEEDED naming
 * the round when the root does not answer, the root's error when the round failed there,
 * UNAVAILABLE when the stream to the sidecar broke, FAILED_PRECONDITION at once for a round this
 * client did not start with a late scope (or whose result 4096 newer ones pushed out). */
hsbn_result hsbn_client_global_stats(hsbn_client* client, uint32_t op, uint64_t seq,
                                     int64_t channels, int64_t* out_count, double* out_mean,
                                     double* out_m2);
/* hsbn_client_global_stats in slices of at most timeout_ms: *done = 0 when the slice ended
 * first (nothing written; call again, the round timeout counts from the first slice), else 1
 * and the result as hsbn_client_global_stats's. */
hsbn_result hsbn_client_global_stats_for(hsbn_client* client, uint32_t op, uint64_t seq,
                                         int64_t channels, int64_t timeout_ms, int* done,
                                         int64_t* out_count, double* out_mean, double* out_m2);
/* Names n layers (ops[i] -> names[i], NUL-terminated) for the aggregators' Status and divergence
 * record, which show op numbers otherwise; names change no round (hsbn::Client::NameLayers). */
hsbn_result hsbn_client_name_layers(hsbn_client* client, const uint32_t* ops,
                                    const char* const* names, size_t n);
/* (ABI 6) Reports that lagged layer `op`'s trip guard sent it exact global at its call of
 * round seq, after its job statistics moved by `drift` (v; >= 0, +Inf allowed), for the next
 * exact_calls (>= 1) calls: shown in the sidecar's Status and metrics
 * (hsbn::Client::ReportLaggedTrip); changes no round. */
hsbn_result hsbn_client_report_lagged_trip(hsbn_client* client, uint32_t op, uint64_t seq,
                                           double drift, int64_t exact_calls);
/* 1 when hsbn_client_global_stats(op, seq) would return at once, else 0 (-1: null client).
 * Never blocks. */
int hsbn_client_global_stats_ready(hsbn_client* client, uint32_t op, uint64_t seq);
/* Lagged scope (ABI 4): the job's count, sum_dy[channels] and sum_dy_xmu[channels] of backward
 * round (op, seq), started with HSBN_SCOPE_LAGGED on this client. sum_dy_xmu is the job's
 * sum of dy * (x - mean) around `mean`, the job's mean of forward round (op, seq) (what
 * hsbn_client_global_stats gives), whatever mean each node's ranks contributed around (their
 * node's, by the protocol); count is the job's count of that forward round. Blocks, fails and
 * keeps results as hsbn_client_global_stats does; every worker gets the same bits. */
hsbn_result hsbn_client_global_sums(hsbn_client* client, uint32_t op, uint64_t seq,
                                    int64_t channels, int64_t* out_count, double* out_sum_dy,
                                    double* out_sum_dy_xmu);
/* hsbn_client_global_sums in slices of at most timeout_ms, as hsbn_client_global_stats_for. */
hsbn_result hsbn_client_global_sums_for(hsbn_client* client, uint32_t op, uint64_t seq,
                                        int64_t channels, int64_t timeout_ms, int* done,
                                        int64_t* out_count, double* out_sum_dy,
                                        double* out_sum_dy_xmu);
/* 1 when hsbn_client_global_sums(op, seq) would return at once, else 0 (-1: null client). */
int hsbn_client_global_sums_ready(hsbn_client* client, uint32_t op, uint64_t seq);

/* One backward round, blocking: contributes (sum_dy, sum_dy_xmu), receives their sums over the
 * scope. `count` is this worker's count; *out_count the scope's. */
hsbn_result hsbn_backward(hsbn_client* client, uint32_t op, uint64_t seq, hsbn_scope scope,
                          int64_t channels, int64_t count, const double* sum_dy,
                          const double* sum_dy_xmu, int64_t* out_count, double* out_sum_dy,
                          double* out_sum_dy_xmu);

/* Asynchronous rounds: start copies the inputs and sends them; wait blocks for the result,
 * writes the outputs and frees the round (also when it fails). Wait for every started round
 * before hsbn_client_destroy: a round refers to its client. */
hsbn_result hsbn_round_start(hsbn_client* client, hsbn_phase phase, uint32_t op, uint64_t seq,
                             hsbn_scope scope, int64_t channels, int64_t count, const double* a,
                             const double* b, hsbn_round** out);
hsbn_result hsbn_round_wait(hsbn_round* round, int64_t* out_count, double* out_a, double* out_b);
/* One slice of hsbn_round_wait, at most timeout_ms long: *done = 0 (and HSBN_OK) while the round
 * is still open: the round stays valid, call again (its deadline counts from the first slice);
 * *done = 1: as hsbn_round_wait (the outputs written, the round freed, the result code its
 * outcome). For callers that must look at other things while they wait: Python waits in slices
 * of 200 ms so that Ctrl-C raises KeyboardInterrupt. */
hsbn_result hsbn_round_wait_for(hsbn_round* round, int64_t timeout_ms, int* done,
                                int64_t* out_count, double* out_a, double* out_b);

/* Gives up on the job (NCCL's ncclCommAbort): every round of this client in flight and every
 * later one fails at once with HSBN_ABORTED and `reason` (NULL: none given), and the sidecar is
 * told, so every other rank's rounds fail at once too, with HSBN_ABORTED naming this rank and
 * `reason` (docs/PROTOCOL.md, "Abort"). Callable from any thread, also while others wait in
 * rounds of this client; the first call's reason stands. Destroy the client afterwards. */
hsbn_result hsbn_client_abort(hsbn_client* client, const char* reason);

/* The client's round statistics (see hsbn_stats); cheap, callable from any thread at any time.
 * INVALID_ARGUMENT if struct_size is smaller than the first version of hsbn_stats (one that
 * ends with elapsed_seconds). */
hsbn_result hsbn_client_stats(const hsbn_client* client, hsbn_stats* out);
/* Zeroes the client's round statistics and restarts elapsed_seconds. Rounds in flight are
 * counted when they end. */
hsbn_result hsbn_client_reset_stats(hsbn_client* client);

/* Auto scope (docs/PROTOCOL.md, "Auto scope"). A policy per op; every rank must give an op the
 * same. Defaults: HSBN_AUTO_WARMUP (50), HSBN_AUTO_MAX_MEAN_SHIFT (0.05),
 * HSBN_AUTO_MAX_LOG_VAR_RATIO (0.05), HSBN_AUTO_RECHECK_EVERY (0: never). */
typedef struct hsbn_auto_policy {
  int64_t warmup_rounds;       /* forward rounds seq 0 .. warmup_rounds-1 run in shadow; >= 1 */
  double max_mean_shift;       /* thresholds on the root's record; above either: global */
  double max_log_var_ratio;
  int64_t recheck_every;       /* 0: decide once; N: sample one round in N in shadow after a
                                  decision, and decide again after warmup_rounds samples */
} hsbn_auto_policy;

typedef struct hsbn_auto_decision {
  int32_t decided;             /* 0: not yet (warm-up) */
  int32_t scope;               /* HSBN_SCOPE_NODE, _GROUP or _GLOBAL once decided */
  double mean_shift;           /* the root's numbers behind it (0 for a restored decision) */
  double log_var_ratio;
  int64_t rounds;              /* shadow rounds it was decided from (fewest over nodes/groups) */
  int64_t decided_at;          /* seq of the decision round; -1: restored */
} hsbn_auto_decision;

/* Sets op's policy (before its first auto round; FAILED_PRECONDITION after it, if different). */
hsbn_result hsbn_set_auto_policy(hsbn_client* client, uint32_t op, const hsbn_auto_policy* policy);
/* What op has decided so far. */
hsbn_result hsbn_get_auto_decision(const hsbn_client* client, uint32_t op,
                                   hsbn_auto_decision* out);
/* Restores a saved decision (HSBN_SCOPE_NODE, _GROUP or _GLOBAL): op skips its warm-up. */
hsbn_result hsbn_set_auto_decision(hsbn_client* client, uint32_t op, hsbn_scope scope);

/* The sidecar's status (jobs, members, open rounds, shadow divergence) as JSON text.
 * Writes at most buf_len bytes including the terminating NUL; *needed gets the full size. */
hsbn_result hsbn_status_json(hsbn_client* client, int include_upstream, char* buf, size_t buf_len,
                             size_t* needed);

/* An operator's view: the status of the aggregator at an address, without joining a job.
 * Initialise with hsbn_status_query_init(), then set fields. */
typedef struct hsbn_status_query {
  size_t struct_size;          /* sizeof(hsbn_status_query); set by hsbn_status_query_init */
  const char* address;         /* "unix:/path/to.sock" or "host:port" of a sidecar or a root */
  const char* job_id;          /* one job, or NULL / "" for every job it shows this caller */
  const char* token;           /* the job's token when the aggregator has --token-file; with
                                  tokens on it answers for that job only. NULL: none */
  int include_upstream;        /* nonzero: a sidecar also asks its root ("upstream" in the JSON) */
  int64_t timeout_ms;          /* 0: 5000 */
  const char* tls_ca_file;     /* PEM CA of a root with --tls-cert (TCP); NULL: plaintext */
  const char* tls_cert_file;   /* PEM client certificate and key for a root with */
  const char* tls_key_file;    /*   --tls-client-ca; NULL: none */
  const char* tls_name;        /* the name in the root's certificate if not the address's host */
} hsbn_status_query;

void hsbn_status_query_init(hsbn_status_query* query);

/* Asks the aggregator named in `query` for its status and writes it as JSON text (protobuf
 * JSON names), like hsbn_status_json. Writes at most buf_len bytes including the terminating
 * NUL; *needed gets the full size (call again with a larger buffer if it is bigger). */
hsbn_result hsbn_query_status_json(const hsbn_status_query* query, char* buf, size_t buf_len,
                                   size_t* needed);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* HSBN_H_ */
