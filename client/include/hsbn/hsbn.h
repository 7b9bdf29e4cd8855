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

#define HSBN_ABI_VERSION 1

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

typedef enum hsbn_scope {
  HSBN_SCOPE_NODE = 1,
  HSBN_SCOPE_GLOBAL = 2,
  HSBN_SCOPE_SHADOW = 3
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

/* Name of a result code ("INVALID_ARGUMENT"); never NULL. */
const char* hsbn_result_string(hsbn_result code);
/* Message of the last failed hsbn call on this thread ("" if none); never NULL. */
const char* hsbn_last_error(void);
/* HSBN_ABI_VERSION of the loaded library. */
int hsbn_abi_version(void);

void hsbn_options_init(hsbn_options* options);

/* Joins the job at the sidecar and opens the round stream. */
hsbn_result hsbn_client_create(const hsbn_options* options, hsbn_client** out);
/* Same, from RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, HSBN_JOB_ID,
 * HSBN_ADDRESS (default unix:/tmp/hsbn.sock), HSBN_ROUND_TIMEOUT_MS, HSBN_TOKEN / HSBN_TOKEN_FILE. */
hsbn_result hsbn_client_create_from_env(hsbn_client** out);
/* Leaves the job and closes the stream. NULL is ignored. */
void hsbn_client_destroy(hsbn_client* client);
hsbn_result hsbn_client_get_info(const hsbn_client* client, hsbn_client_info* out);

/* One forward round, blocking: contributes this worker's (count, mean, m2) and receives the
 * reduced (count, mean, m2) of the scope. Outputs may alias inputs. */
hsbn_result hsbn_forward(hsbn_client* client, uint32_t op, uint64_t seq, hsbn_scope scope,
                         int64_t channels, int64_t count, const double* mean, const double* m2,
                         int64_t* out_count, double* out_mean, double* out_m2);

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

/* The sidecar's status (jobs, members, open rounds, shadow divergence) as JSON text.
 * Writes at most buf_len bytes including the terminating NUL; *needed gets the full size. */
hsbn_result hsbn_status_json(hsbn_client* client, int include_upstream, char* buf, size_t buf_len,
                             size_t* needed);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* HSBN_H_ */
