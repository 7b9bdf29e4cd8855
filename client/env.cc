#include "env.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "wire.h"

namespace hsbn::env {

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

Var Layout(const char* name, int64_t min, const char* doc) {
  Var v{name, Type::kInt};
  v.min = min;
  v.max = kInt32Max;
  v.required = true;
  v.doc = doc;
  return v;
}

Var IntVar(const char* name, int64_t min, int64_t max, const char* unset, const char* doc) {
  Var v{name, Type::kInt};
  v.min = min;
  v.max = max;
  v.unset = unset;
  v.doc = doc;
  return v;
}

Var Of(const char* name, Type type, const char* unset, const char* doc) {
  Var v{name, type};
  v.unset = unset;
  v.doc = doc;
  return v;
}

Var Choice(const char* name, const char* choices, const char* unset, const char* doc) {
  Var v{name, Type::kChoice};
  v.choices = choices;
  v.unset = unset;
  v.doc = doc;
  return v;
}

Var With(Var v, const char* fallback, bool required = false) {
  v.fallback = fallback;
  v.required = required;
  return v;
}

Var PythonOnly(Var v) {
  v.python_only = true;
  return v;
}

const std::vector<Var>& Vars() {
  static const std::vector<Var>* vars = new std::vector<Var>{
      Layout("RANK", 0, "the worker's rank in the job (torchrun sets it)"),
      Layout("WORLD_SIZE", 1, "the number of workers in the job (torchrun sets it)"),
      Layout("LOCAL_RANK", 0, "the worker's rank on its node (torchrun sets it)"),
      Layout("LOCAL_WORLD_SIZE", 1, "workers per node, the same on every node (torchrun sets it)"),
      Layout("GROUP_RANK", 0, "the node's index in the job (torchrun sets it)"),
      With(Of("HSBN_JOB_ID", Type::kText, "",
              "the job's id, the same on every worker and unique among the jobs sharing a "
              "sidecar; unset: torchrun's TORCHELASTIC_RUN_ID (its --rdzv_id) unless \"none\", "
              "else torchrun-MASTER_ADDR-MASTER_PORT (the rendezvous store's address, which every "
              "rank of a job shares and no concurrent job can bind)"),
           "TORCHELASTIC_RUN_ID", /*required=*/true),
      Of("TORCHELASTIC_RUN_ID", Type::kText, "",
         "torchrun's run id (--rdzv_id): the job id when HSBN_JOB_ID is unset; \"none\" is no id"),
      Of("MASTER_ADDR", Type::kText, "",
         "the job's rendezvous host (torchrun sets it): with MASTER_PORT, the job id when neither "
         "HSBN_JOB_ID nor a TORCHELASTIC_RUN_ID other than \"none\" is set"),
      Of("MASTER_PORT", Type::kText, "",
         "the job's rendezvous port (torchrun sets it); see MASTER_ADDR"),
      Of("HSBN_ADDRESS", Type::kAddress, "unix:/tmp/hsbn.sock",
         "the node's sidecar: unix:PATH, unix-abstract:NAME or HOST:PORT"),
      IntVar("HSBN_ROUND_TIMEOUT_MS", 0, kInt32Max, "0",
             "how long a round call waits for its result, in ms; 0: the aggregator's round "
             "timeout + 5 s"),
      IntVar("HSBN_CONNECT_TIMEOUT_MS", 0, kInt32Max, "10000",
             "how long joining waits for the sidecar, in ms; 0: the default, 10 s"),
      With(Of("HSBN_TOKEN", Type::kText, "",
              "the job's token, when the aggregator requires tokens; unset: the contents of "
              "HSBN_TOKEN_FILE"),
           "HSBN_TOKEN_FILE"),
      Of("HSBN_TOKEN_FILE", Type::kPath, "",
         "a file holding the job's token (surrounding white space is dropped)"),
      Of("HSBN_STRICT_FINITE", Type::kFlag, "0",
         "1: the job's strict mode (a NaN or Inf in a contribution fails the round, naming the "
         "rank); 0: non-finite values are data, as in torch's SyncBatchNorm"),
      IntVar("HSBN_GROUP_NODES", 0, int64_t(1) << 30, "0",
             "nodes per group for group scope (a divisor of the number of nodes); 0: no groups"),
      IntVar("HSBN_AUTO_WARMUP", 1, kInt32Max, "50",
             "auto scope: shadow rounds before a layer's decision"),
      Of("HSBN_AUTO_MAX_MEAN_SHIFT", Type::kNumber, "0.05",
         "auto scope: the largest node (group) mean shift, in global standard deviations, that "
         "keeps node (group) scope"),
      Of("HSBN_AUTO_MAX_LOG_VAR_RATIO", Type::kNumber, "0.05",
         "auto scope: the largest |log(node variance / global variance)| that keeps node "
         "(group) scope"),
      IntVar("HSBN_AUTO_RECHECK_EVERY", 0, kInt32Max, "0",
             "auto scope: decide again every N forward rounds after a decision; 0: never"),
      With(IntVar("HSBN_INCARNATION", 0, kInt64Max, "0",
                  "which run of the job this process belongs to (a restarted run must use a "
                  "higher number); unset: torchrun's TORCHELASTIC_RESTART_COUNT"),
           "TORCHELASTIC_RESTART_COUNT"),
      IntVar("TORCHELASTIC_RESTART_COUNT", 0, kInt64Max, "0",
             "torchrun's restart count: the run number when HSBN_INCARNATION is unset"),
      Choice("HSBN_TRANSPORT", "auto|grpc", "auto",
             "how node rounds travel: auto (shared memory where the node can use it, else the "
             "gRPC stream) or grpc (always the stream)"),
      Choice("HSBN_DEBUG", "WARN|INFO", "WARN",
             "INFO: the client says what it does on stderr, one line each, prefixed "
             "\"hsbn[rank R]\": the join and its answer, the node's transport and why, the layer "
             "check, rounds slower than HSBN_DEBUG_SLOW_MS, reconnections, an abort; WARN: "
             "nothing (errors are raised, not printed)"),
      IntVar("HSBN_DEBUG_SLOW_MS", 0, kInt32Max, "1000",
             "with HSBN_DEBUG=INFO: a round the caller waited for longer than this, in ms, is "
             "reported"),
      PythonOnly(Of("HSBN_LIBRARY", Type::kPath, "",
                    "Python: the libhsbn.so to load (unset: the wheel's, then the build tree's)")),
      PythonOnly(Of("HSBN_AGGREGATOR", Type::kPath, "",
                    "Python: the hsbn-aggregator binary that LocalCluster, `hsbn run` and the "
                    "wheel's `hsbn-aggregator` command run (unset: the wheel's, then the build "
                    "tree's)")),
      PythonOnly(Of("HSBN_TORCH_CUSTOM_OPS", Type::kFlag, "",
                    "Python, torch >= 2.4: 1: synchronized layers on CPU tensors run as torch "
                    "custom ops, which torch.compile(fullgraph=True) and torch.export trace "
                    "whole, eagerly too (hsbn.torch.use_custom_ops(True)); 0: their "
                    "autograd.Function everywhere (unset, torch >= 2.4: the ops where "
                    "torch.compile or torch.export traces the layer, the function eagerly; "
                    "older torch: the function)")),
      PythonOnly(Choice("HSBN_TORCH_CPU_OPS", "torch|kernels", "torch",
                        "Python: the arithmetic of synchronized layers on CPU tensors")),
      PythonOnly(Choice("HSBN_TORCH_CUDA_OPS", "torch|kernels", "",
                        "Python: the arithmetic of synchronized layers on CUDA tensors (unset: "
                        "hsbn's kernels on GPUs where they passed the GPU device check, compute "
                        "capability 9.0; torch's ops on others; `python -m hsbn` says which)")),
  };
  return *vars;
}

absl::Status Bad(const Var& v, absl::string_view value, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat(v.name, "='", wire::Printable(value, 64), "' ", why));
}

// `text` checked against `v`'s type, written canonically.
absl::StatusOr<std::string> Check(const Var& v, const std::string& text) {
  switch (v.type) {
    case Type::kInt: {
      int64_t i;
      if (!absl::SimpleAtoi(text, &i)) {
        // Digits that do not fit in int64 are out of range, not "not an integer".
        const bool digits = !text.empty() &&
                            text.find_first_not_of("0123456789", text[0] == '-' ? 1 : 0) ==
                                std::string::npos &&
                            text != "-";
        if (!digits) return Bad(v, text, "is not an integer");
        return absl::InvalidArgumentError(absl::StrCat(
            v.name, "=", wire::Printable(text, 64), " is out of range [", v.min, ", ", v.max, "]"));
      }
      if (i < v.min || i > v.max) {
        return absl::InvalidArgumentError(
            absl::StrCat(v.name, "=", i, " is out of range [", v.min, ", ", v.max, "]"));
      }
      return absl::StrCat(i);
    }
    case Type::kNumber: {
      double d;
      if (!absl::SimpleAtod(text, &d)) return Bad(v, text, "is not a number");
      if (!std::isfinite(d) || !(d >= 0)) {
        return Bad(v, text, "must be a finite number >= 0");
      }
      return absl::StrCat(d);
    }
    case Type::kFlag:
      if (text == "0" || text == "1") return text;
      return Bad(v, text, "is not 0 or 1");
    case Type::kChoice:
      for (absl::string_view c : absl::StrSplit(v.choices, '|')) {
        if (c == text) return text;
      }
      return Bad(v, text, absl::StrCat("is not one of ", absl::StrReplaceAll(v.choices, {{"|", ", "}})));
    case Type::kAddress:
      if (absl::Status s = CheckAddress(text, v.name); !s.ok()) return s;
      return text;
    case Type::kText:
    case Type::kPath:
      return text;
  }
  return text;
}

}  // namespace

absl::Span<const Var> Table() { return Vars(); }

const Var* Find(absl::string_view name) {
  for (const Var& v : Vars()) {
    if (name == v.name) return &v;
  }
  return nullptr;
}

Source Source::Process() { return Source(); }

Source Source::Entries(const char* const* entries) {
  Source s;
  s.process_ = false;
  for (; entries != nullptr && *entries != nullptr; ++entries) {
    absl::string_view e(*entries);
    const size_t eq = e.find('=');
    if (eq == absl::string_view::npos || eq == 0) continue;
    s.entries_[std::string(e.substr(0, eq))] = std::string(e.substr(eq + 1));
  }
  return s;
}

std::optional<std::string> Source::Get(absl::string_view name) const {
  if (process_) {
    const char* v = std::getenv(std::string(name).c_str());
    if (v == nullptr || *v == '\0') return std::nullopt;
    return std::string(v);
  }
  auto it = entries_.find(name);
  if (it == entries_.end() || it->second.empty()) return std::nullopt;
  return it->second;
}

absl::StatusOr<std::string> Resolve(const Source& source, absl::string_view name) {
  const Var* v = Find(name);
  if (v == nullptr) {
    return absl::NotFoundError(absl::StrCat("'", wire::Printable(name, 64),
                                            "' is not a variable hsbn reads (docs/ENVIRONMENT.md)"));
  }
  if (std::optional<std::string> text = source.Get(v->name)) return Check(*v, *text);
  if (*v->fallback != '\0') {
    const Var* f = Find(v->fallback);
    std::optional<std::string> text = source.Get(f->name);
    if (text && f->type == Type::kPath) {  // HSBN_TOKEN_FILE: the file's contents
      std::ifstream in(*text);
      if (!in) {
        return absl::InvalidArgumentError(
            absl::StrCat(f->name, "=", wire::Printable(*text, 256), " cannot be read"));
      }
      std::stringstream ss;
      ss << in.rdbuf();
      return Check(*v, std::string(absl::StripAsciiWhitespace(ss.str())));
    }
    // torchrun without --rdzv_id sets TORCHELASTIC_RUN_ID=none: not an id that tells jobs apart.
    if (text && !(std::strcmp(v->name, "HSBN_JOB_ID") == 0 && *text == "none")) {
      absl::StatusOr<std::string> checked = Check(*f, *text);
      if (!checked.ok()) return checked.status();
      return Check(*v, *checked);
    }
  }
  if (v->required) {
    if (std::strcmp(v->name, "HSBN_JOB_ID") == 0) {
      // Plain torchrun (no --rdzv_id): its store's host and port are the same on every rank of
      // the job, and no two live jobs can have bound the same port on the same host.
      std::optional<std::string> host = source.Get("MASTER_ADDR");
      std::optional<std::string> port = source.Get("MASTER_PORT");
      if (host && port) return Check(*v, absl::StrCat("torchrun-", *host, "-", *port));
      return absl::InvalidArgumentError(
          "HSBN_JOB_ID is not set (nor torchrun's TORCHELASTIC_RUN_ID, nor MASTER_ADDR and "
          "MASTER_PORT): give every process of the job the same HSBN_JOB_ID, unique among the "
          "jobs sharing a sidecar (hsbn run sets one)");
    }
    return absl::InvalidArgumentError(absl::StrCat(
        v->name, " is not set. Launch the trainer with torchrun, or set RANK, WORLD_SIZE, "
                 "LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK yourself"));
  }
  return std::string(v->unset);
}

absl::StatusOr<int64_t> Int(const Source& source, absl::string_view name) {
  absl::StatusOr<std::string> text = Resolve(source, name);
  if (!text.ok()) return text.status();
  int64_t i = 0;
  if (!text->empty() && !absl::SimpleAtoi(*text, &i)) {
    return absl::InternalError(absl::StrCat(name, " is not an integer variable"));
  }
  return i;
}

absl::StatusOr<double> Number(const Source& source, absl::string_view name) {
  absl::StatusOr<std::string> text = Resolve(source, name);
  if (!text.ok()) return text.status();
  double d = 0;
  if (!text->empty() && !absl::SimpleAtod(*text, &d)) {
    return absl::InternalError(absl::StrCat(name, " is not a number variable"));
  }
  return d;
}

absl::StatusOr<bool> Flag(const Source& source, absl::string_view name) {
  absl::StatusOr<std::string> text = Resolve(source, name);
  if (!text.ok()) return text.status();
  return *text == "1";
}

absl::Status CheckAddress(absl::string_view address, absl::string_view what) {
  // gRPC's other client targets pass as they are; everything else is the aggregator's forms.
  for (absl::string_view scheme : {"unix-abstract:", "dns:", "ipv4:", "ipv6:"}) {
    if (absl::StartsWith(address, scheme) && address.size() > scheme.size()) {
      return absl::OkStatus();
    }
  }
  if (std::string e = wire::AddressError(what, address, /*unix_ok=*/true, /*min_port=*/1);
      !e.empty()) {
    return absl::InvalidArgumentError(e);
  }
  return absl::OkStatus();
}

std::string Markdown() {
  auto type = [](const Var& v) -> std::string {
    switch (v.type) {
      case Type::kInt: return absl::StrCat("integer in [", v.min, ", ", v.max, "]");
      case Type::kNumber: return "number >= 0";
      case Type::kFlag: return "0 or 1";
      case Type::kChoice: return absl::StrReplaceAll(v.choices, {{"|", " or "}});
      case Type::kText: return "text";
      case Type::kAddress: return "address";
      case Type::kPath: return "path";
    }
    return "";
  };
  std::string out =
      "# Environment variables\n\n"
      "Every variable a trainer process reads, from the one table that parses them\n"
      "(`client/env.cc`; this file is `hsbn env --markdown`, and a test keeps the two equal).\n"
      "The C++ client (`ClientOptions::FromEnv`), the C ABI (`hsbn_client_create`,\n"
      "`hsbn_env_get`) and Python (`hsbn.Client.from_env(env=...)`, `hsbn.env`) read them the\n"
      "same way: a value outside its type or range is refused, naming the variable. An empty\n"
      "variable counts as unset. Keyword arguments of `hsbn.Client(...)` and the fields of\n"
      "`hsbn_options` set the same things and win over the environment.\n\n"
      "| variable | type | unset | what it sets |\n"
      "|---|---|---|---|\n";
  for (const Var& v : Vars()) {
    std::string unset = *v.unset ? absl::StrCat("`", v.unset, "`") : std::string();
    if (v.required && *v.fallback == '\0') unset = "required";
    if (*v.fallback != '\0') {
      unset = absl::StrCat(unset.empty() ? "" : unset + "; ", "`", v.fallback, "`",
                           v.required ? ", else required" : "");
    }
    absl::StrAppend(&out, "| `", v.name, "` | ", type(v), " | ", unset, " | ", v.doc, " |\n");
  }
  return out;
}

}  // namespace hsbn::env
