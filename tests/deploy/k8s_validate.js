#!/usr/bin/env node
// Renders every overlay under deploy/k8s/overlays with `kubectl kustomize` (offline) and checks
// each object against the Kubernetes OpenAPI schemas shipped in the npm package
// kubernetes-models, rejecting unknown fields as well as wrong types. Then it checks what hsbn
// needs of the objects: the sidecar and the trainer share a memory-backed emptyDir holding the
// socket that HSBN_ADDRESS names, aggregator flags are in deploy/aggregator-flags.txt, every
// $(VAR) resolves, every sidecar --upstream names a Service that selects a root.
//
//   node k8s_validate.js DEPLOY_K8S_DIR              validate; exit 1 on any error
//   node k8s_validate.js --self-test DEPLOY_K8S_DIR  break copies on purpose; each must fail
"use strict";

const fs = require("fs");
const os = require("os");
const path = require("path");
const { execFileSync } = require("child_process");
const YAML = require("yaml");

const SCHEMA_DIR = path.join(path.dirname(require.resolve("kubernetes-models/v1/Pod")), "..", "_schemas");
const SCHEMAS = {
  "apps/v1/Deployment": "IoK8sApiAppsV1Deployment",
  "batch/v1/Job": "IoK8sApiBatchV1Job",
  "v1/Service": "IoK8sApiCoreV1Service",
  "v1/ConfigMap": "IoK8sApiCoreV1ConfigMap",
  "v1/ServiceAccount": "IoK8sApiCoreV1ServiceAccount",
  "networking.k8s.io/v1/NetworkPolicy": "IoK8sApiNetworkingV1NetworkPolicy",
};

function loadFlagContract(k8sDir) {
  const file = path.join(k8sDir, "..", "aggregator-flags.txt");
  const flags = new Set();
  for (const line of fs.readFileSync(file, "utf8").split("\n")) {
    const t = line.replace(/#.*/, "").trim();
    if (t) flags.add(t.split(/\s+/)[0]);
  }
  return flags;
}

function render(overlayDir) {
  const out = execFileSync("kubectl", ["kustomize", overlayDir], { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
  return YAML.parseAllDocuments(out).map((d) => {
    if (d.errors.length) throw new Error(`${overlayDir}: YAML: ${d.errors[0].message}`);
    return d.toJS();
  }).filter((o) => o);
}

// Schema check with unknown-field detection: the compiled validators read every property the
// schema knows, so a property of the object that the validator never read is not in the schema.
function schemaErrors(obj) {
  const key = `${obj.apiVersion}/${obj.kind}`;
  const name = SCHEMAS[key];
  const where = `${obj.kind}/${obj.metadata && obj.metadata.name}`;
  if (!name) return [`${where}: no schema known for ${key}; add it to SCHEMAS`];
  const { validate } = require(path.join(SCHEMA_DIR, `${name}.js`));
  const seen = new Set();
  const track = (o, p) => (o === null || typeof o !== "object") ? o : new Proxy(o, {
    get(t, k, r) {
      if (typeof k !== "string") return Reflect.get(t, k, r);
      seen.add(`${p}/${k}`);
      return track(t[k], `${p}/${k}`);
    },
  });
  const errors = [];
  if (!validate(track(obj, ""))) {
    for (const e of validate.errors) errors.push(`${where}: schema: ${e.instancePath || "/"} ${e.message || `${e.keyword} ${JSON.stringify(e.params)}`}`);
    return errors;
  }
  const walk = (o, p) => {
    if (o === null || typeof o !== "object") return;
    for (const k of Object.keys(o)) {
      if (p === "" && (k === "apiVersion" || k === "kind")) continue;
      if (!seen.has(`${p}/${k}`)) errors.push(`${where}: schema: unknown field ${p}/${k}`);
      else walk(o[k], `${p}/${k}`);
    }
  };
  walk(obj, "");
  return errors;
}

function podTemplate(obj) {
  if (obj.kind === "Deployment" || obj.kind === "Job") return obj.spec.template;
  return null;
}

function flagsOf(container) {
  const flags = {};
  for (const a of container.args || []) {
    const m = /^(--[a-z0-9-]+)(?:=(.*))?$/.exec(a);
    if (m) flags[m[1]] = m[2] === undefined ? "" : m[2];
  }
  return flags;
}

const isAggregator = (c) => (c.args || []).some((a) => a.startsWith("--role="));
const envValue = (c, name) => { const e = (c.env || []).find((x) => x.name === name); return e && e.value; };

function resolveEnv(c, s) {
  return s.replace(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (m, v) => (envValue(c, v) !== undefined ? envValue(c, v) : m));
}

function hsbnErrors(objs, contract) {
  const errors = [];
  const services = objs.filter((o) => o.kind === "Service");
  const templates = objs.map((o) => [o, podTemplate(o)]).filter(([, t]) => t);
  for (const [obj, tpl] of templates) {
    const where = `${obj.kind}/${obj.metadata.name}`;
    const spec = tpl.spec;
    const all = [...(spec.initContainers || []), ...spec.containers];
    if (!(spec.securityContext && spec.securityContext.runAsNonRoot === true)) errors.push(`${where}: pod must set securityContext.runAsNonRoot: true`);
    for (const c of all) {
      const cw = `${where}: container ${c.name}`;
      if (!(c.securityContext && c.securityContext.allowPrivilegeEscalation === false)) errors.push(`${cw}: must set allowPrivilegeEscalation: false`);
      const names = new Set((c.env || []).map((e) => e.name));
      const refs = [...(c.command || []), ...(c.args || []), ...(c.env || []).map((e) => e.value || "")];
      for (const s of refs) for (const m of s.matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
        if (!names.has(m[1])) errors.push(`${cw}: undefined variable $(${m[1]}) in "${s}"`);
      }
      if (!isAggregator(c)) continue;
      const flags = flagsOf(c);
      for (const a of c.args) if (!/^--[a-z0-9-]+=/.test(a)) errors.push(`${cw}: aggregator argument "${a}" is not --flag=value`);
      for (const f of Object.keys(flags)) if (!contract.has(f)) errors.push(`${cw}: ${f} is not in the aggregator's flag contract (deploy/aggregator-flags.txt)`);
      if (!["node", "root"].includes(flags["--role"])) errors.push(`${cw}: --role must be node or root`);
      if (!flags["--listen"]) errors.push(`${cw}: --listen is missing`);
      if (!(c.securityContext && c.securityContext.readOnlyRootFilesystem === true)) errors.push(`${cw}: aggregator must run with readOnlyRootFilesystem: true`);
      if (flags["--upstream"] !== undefined) {
        const [host, port] = flags["--upstream"].split(":");
        const svc = services.find((s) => s.metadata.name === host);
        if (!svc) { errors.push(`${cw}: --upstream=${flags["--upstream"]}: no Service named ${host} in this overlay`); continue; }
        if (!svc.spec.ports.some((p) => String(p.port) === port)) errors.push(`${cw}: Service ${host} has no port ${port}`);
        const sel = svc.spec.selector || {};
        const roots = templates.filter(([, t]) => Object.entries(sel).every(([k, v]) => (t.metadata.labels || {})[k] === v)
          && t.spec.containers.some((x) => flagsOf(x)["--role"] === "root"));
        if (!roots.length) errors.push(`${cw}: Service ${host} selects no pod running --role=root`);
      }
    }
    if (obj.kind !== "Job") continue;
    // The trainer Job: a native sidecar and a trainer sharing the socket directory in memory.
    const sidecar = (spec.initContainers || []).find((c) => flagsOf(c)["--role"] === "node");
    if (!sidecar) { errors.push(`${where}: no sidecar (init container running --role=node)`); continue; }
    if (sidecar.restartPolicy !== "Always") errors.push(`${where}: sidecar ${sidecar.name} must be a native sidecar (restartPolicy: Always)`);
    const listen = flagsOf(sidecar)["--listen"] || "";
    if (!listen.startsWith("unix:")) { errors.push(`${where}: sidecar must listen on a unix: socket, not "${listen}"`); continue; }
    const sockDir = path.posix.dirname(listen.slice(5));
    const mount = (sidecar.volumeMounts || []).find((m) => m.mountPath === sockDir);
    const vol = mount && (spec.volumes || []).find((v) => v.name === mount.name);
    if (!vol) errors.push(`${where}: sidecar socket directory ${sockDir} is not a mounted volume`);
    else if (!(vol.emptyDir && vol.emptyDir.medium === "Memory")) errors.push(`${where}: volume ${vol.name} holding the socket must be an emptyDir with medium: Memory`);
    const nodes = obj.spec.completions || 1;
    if (nodes > 1 && flagsOf(sidecar)["--upstream"] === undefined) errors.push(`${where}: a multi-node Job needs --upstream on its sidecar`);
    for (const c of spec.containers) {
      if (!(c.volumeMounts || []).some((m) => mount && m.name === mount.name && m.mountPath === sockDir)) errors.push(`${where}: container ${c.name} does not mount the socket volume at ${sockDir}`);
      if (envValue(c, "HSBN_ADDRESS") !== listen) errors.push(`${where}: container ${c.name}: HSBN_ADDRESS=${envValue(c, "HSBN_ADDRESS")} but the sidecar listens on ${listen}`);
      if (!(c.env || []).some((e) => e.name === "HSBN_JOB_ID")) errors.push(`${where}: container ${c.name}: HSBN_JOB_ID is not set`);
      const nn = (c.args || []).map((a) => resolveEnv(c, a)).find((a) => a.startsWith("--nnodes="));
      if (nn && Number(nn.split("=")[1]) !== nodes) errors.push(`${where}: container ${c.name}: torchrun ${nn} but the Job runs ${nodes} pod(s)`);
    }
  }
  for (const svc of services) {
    const sel = svc.spec.selector || {};
    const podLabels = (t) => ({ ...(t.metadata.labels || {}), "batch.kubernetes.io/job-name": undefined });
    const match = templates.some(([o, t]) => Object.entries(sel).every(([k, v]) =>
      (k === "batch.kubernetes.io/job-name" && o.kind === "Job") ? o.metadata.name === v : podLabels(t)[k] === v));
    if (!match) errors.push(`Service/${svc.metadata.name}: selector ${JSON.stringify(sel)} matches no pod template`);
  }
  return errors;
}

function validateTree(k8sDir, only) {
  const contract = loadFlagContract(k8sDir);
  const overlays = only || fs.readdirSync(path.join(k8sDir, "overlays")).sort();
  const report = [];
  for (const o of overlays) {
    const dir = path.join(k8sDir, "overlays", o);
    let objs;
    try { objs = render(dir); } catch (e) { report.push({ overlay: o, errors: [`kustomize failed: ${(e.stderr || e.message).toString().split("\n")[0]}`], count: 0 }); continue; }
    const errors = objs.flatMap(schemaErrors).concat(hsbnErrors(objs, contract));
    report.push({ overlay: o, errors, count: objs.length, kinds: objs.map((x) => `${x.kind}/${x.metadata.name}`) });
  }
  return report;
}

// Deliberately broken copies, each must be rejected with the message named here. A few are
// broken in the source and rendered again with kustomize; the rest break one field of the
// rendered multi-node objects (rendering is the slow part).
const SOURCE_MUTATIONS = [
  ["base/trainer-job.yaml", "imagePullPolicy: IfNotPresent", "imagePullPolice: IfNotPresent", "unknown field /spec/template/spec/initContainers/0/imagePullPolice"],
  ["base/root.yaml", "containerPort: 7070", "containerPort: grpc-port", '/ports/0/containerPort type {"type":"integer"}'],
  ["overlays/multi-node/kustomization.yaml", "  - train-headless-service.yaml", "  - train-headless-svc.yaml", "kustomize failed"],
];
const find = (objs, kind, name) => objs.find((o) => o.kind === kind && o.metadata.name === name);
const job = (objs) => find(objs, "Job", "hsbn-train").spec.template.spec;
const sidecar = (objs) => job(objs).initContainers[0];
const trainer = (objs) => job(objs).containers[0];
const root = (objs) => find(objs, "Deployment", "hsbn-root").spec.template;
const OBJECT_MUTATIONS = [
  ["volumeMount without mountPath", (o) => { sidecar(o).volumeMounts[0] = { name: "hsbn-run" }; }, '"missingProperty":"mountPath"'],
  ["socket volume on disk", (o) => { delete job(o).volumes.find((v) => v.name === "hsbn-run").emptyDir.medium; }, "medium: Memory"],
  ["upstream to a missing Service", (o) => { sidecar(o).args = sidecar(o).args.map((a) => a.replace("hsbn-root:", "hsbn-rooot:")); }, "no Service named hsbn-rooot"],
  ["HSBN_ADDRESS elsewhere", (o) => { trainer(o).env.find((e) => e.name === "HSBN_ADDRESS").value = "unix:/run/hsbn/other.sock"; }, "HSBN_ADDRESS=unix:/run/hsbn/other.sock"],
  ["flag not in the contract", (o) => { root(o).spec.containers[0].args.push("--round-timeout=30000"); }, "not in the aggregator's flag contract"],
  ["undefined $(VAR)", (o) => { trainer(o).args = trainer(o).args.map((a) => a.replace("$(NODE_RANK)", "$(NODE_RANKK)")); }, "undefined variable $(NODE_RANKK)"],
  ["nnodes != pods", (o) => { const j = find(o, "Job", "hsbn-train"); j.spec.completions = j.spec.parallelism = 3; }, "--nnodes=2 but the Job runs 3"],
  ["sidecar not native", (o) => { delete sidecar(o).restartPolicy; }, "native sidecar"],
  ["root Service selects nothing", (o) => { root(o).metadata.labels["app.kubernetes.io/component"] = "rooot"; }, "selects no pod running --role=root"],
  ["root as root user", (o) => { delete root(o).spec.securityContext.runAsNonRoot; }, "runAsNonRoot"],
  ["no HSBN_JOB_ID", (o) => { trainer(o).env = trainer(o).env.filter((e) => e.name !== "HSBN_JOB_ID"); }, "HSBN_JOB_ID is not set"],
  ["single pod needs no upstream; two do", (o) => { sidecar(o).args = sidecar(o).args.filter((a) => !a.startsWith("--upstream=")); }, "needs --upstream"],
];

function selfTest(k8sDir) {
  let failed = 0;
  const check = (label, errors, expect) => {
    const hit = errors.find((e) => e.includes(expect));
    if (hit) console.log(`ok: ${label} rejected: ${hit}`);
    else { console.log(`FAIL: ${label} was not rejected with "${expect}"; got: ${JSON.stringify(errors)}`); failed++; }
  };
  const contract = loadFlagContract(k8sDir);
  const clean = render(path.join(k8sDir, "overlays", "multi-node"));
  const cleanErrors = clean.flatMap(schemaErrors).concat(hsbnErrors(clean, contract));
  if (cleanErrors.length) { console.log(`FAIL: overlays/multi-node does not validate:\n  ${cleanErrors.join("\n  ")}`); return 1; }
  for (const [label, mutate, expect] of OBJECT_MUTATIONS) {
    const objs = JSON.parse(JSON.stringify(clean));
    mutate(objs);
    check(label, objs.flatMap(schemaErrors).concat(hsbnErrors(objs, contract)), expect);
  }
  for (const [file, from, to, expect] of SOURCE_MUTATIONS) {
    const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "hsbn-k8s-"));
    const copy = path.join(tmp, "k8s");
    fs.cpSync(k8sDir, copy, { recursive: true });
    fs.copyFileSync(path.join(k8sDir, "..", "aggregator-flags.txt"), path.join(tmp, "aggregator-flags.txt"));
    const target = path.join(copy, file);
    const text = fs.readFileSync(target, "utf8");
    if (!text.includes(from)) { console.log(`FAIL: ${file} no longer contains ${JSON.stringify(from)}; update SOURCE_MUTATIONS`); failed++; continue; }
    fs.writeFileSync(target, text.replace(from, to));
    const errors = validateTree(copy, ["multi-node"]).flatMap((r) => r.errors);
    fs.rmSync(tmp, { recursive: true, force: true });
    check(`${file}: ${JSON.stringify(to.trim())}`, errors, expect);
  }
  const total = OBJECT_MUTATIONS.length + SOURCE_MUTATIONS.length;
  console.log(`${total - failed} passed, ${failed} failed`);
  return failed ? 1 : 0;
}

function main() {
  const args = process.argv.slice(2);
  const self = args[0] === "--self-test";
  const dir = path.resolve(self ? args[1] : args[0]);
  if (self) process.exit(selfTest(dir));
  let bad = 0;
  for (const r of validateTree(dir)) {
    console.log(`${r.errors.length ? "FAIL" : "ok"}: overlays/${r.overlay}: ${r.count} objects${r.kinds ? " (" + r.kinds.join(", ") + ")" : ""}`);
    for (const e of r.errors) console.log(`  ${e}`);
    bad += r.errors.length ? 1 : 0;
  }
  process.exit(bad ? 1 : 0);
}

main();
