#!/usr/bin/env node
// Lints docker/*.Dockerfile offline: the npm package dockerfile-utils (the Dockerfile language
// service's validator: instructions, flags, arguments) must report nothing, and hsbn's image
// rules must hold (pinned bases, apt and pip hygiene, multi-stage, non-root final stage,
// healthcheck on the aggregator, a build stage that runs scripts/setup.sh and is the same in
// every Dockerfile, COPY sources that exist).
//
//   node docker_lint.js REPO              lint; exit 1 on any finding
//   node docker_lint.js --self-test REPO  break copies on purpose; each must be caught
"use strict";

const fs = require("fs");
const path = require("path");
const { validate } = require("dockerfile-utils");

// Every diagnostic dockerfile-utils knows about is an error here.
const STRICT = Object.fromEntries([
  "deprecatedMaintainer", "directiveCasing", "emptyContinuationLine", "instructionCasing",
  "instructionCmdMultiple", "instructionEntrypointMultiple", "instructionHealthcheckMultiple",
  "instructionJSONInSingleQuotes", "instructionWorkdirRelative",
].map((k) => [k, 1 /* ValidationSeverity.ERROR */]));

function instructions(text) {
  const lines = text.replace(/\\\n/g, " ").split("\n");
  return lines.map((l, i) => ({ line: i + 1, text: l.trim() }))
    .filter((l) => l.text && !l.text.startsWith("#"))
    .map((l) => { const m = /^(\S+)\s*(.*)$/.exec(l.text); return { line: l.line, kw: m[1].toUpperCase(), args: m[2] }; });
}

function stages(instrs) {
  const argDefaults = {};
  const out = [];
  for (const ins of instrs) {
    if (ins.kw === "ARG" && !out.length) {
      const [k, v] = ins.args.split("=");
      argDefaults[k] = v;
    } else if (ins.kw === "FROM") {
      const m = /^(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?$/i.exec(ins.args);
      const image = m[1].replace(/\$\{?(\w+)\}?/g, (_, k) => argDefaults[k] || "");
      out.push({ image, name: m[2], line: ins.line, body: [] });
    } else if (out.length) out[out.length - 1].body.push(ins);
  }
  return out;
}

function lint(file, repo) {
  const text = fs.readFileSync(file, "utf8");
  const rel = path.relative(repo, file);
  const errs = validate(text, STRICT).map((d) => `${rel}:${d.range.start.line + 1}: dockerfile-utils: ${d.message}`);
  const instrs = instructions(text);
  const st = stages(instrs);
  const at = (ins, msg) => errs.push(`${rel}:${ins.line}: ${msg}`);
  if (st.length < 2) errs.push(`${rel}: must be multi-stage (a build stage and a runtime stage)`);
  const names = st.map((s) => s.name).filter(Boolean);
  for (const s of st) {
    const tag = /^[^@]+:([^/:@]+)$/.exec(s.image);
    if (!tag && !s.image.includes("@sha256:")) at(s, `base image ${s.image} has no tag`);
    else if (tag && tag[1] === "latest") at(s, `base image ${s.image} uses :latest`);
    for (const ins of s.body) {
      if (ins.kw === "ADD" && /https?:\/\//.test(ins.args)) at(ins, "ADD of a URL: download in a RUN step you can check");
      if (ins.kw === "COPY") {
        const from = /--from=(\S+)/.exec(ins.args);
        if (from && !names.includes(from[1])) at(ins, `COPY --from=${from[1]}: no such stage`);
        if (!from) {
          const srcs = ins.args.replace(/--\S+/g, "").trim().split(/\s+/).slice(0, -1);
          for (const src of srcs) if (src !== "." && !fs.existsSync(path.join(repo, src))) at(ins, `COPY ${src}: not in the repository`);
        }
      }
      if (ins.kw !== "RUN") continue;
      if (/apt-get install/.test(ins.args)) {
        if (!/apt-get install[^&|;]*\s-y\b/.test(ins.args)) at(ins, "apt-get install without -y");
        if (!/--no-install-recommends/.test(ins.args)) at(ins, "apt-get install without --no-install-recommends");
        if (!/apt-get update/.test(ins.args)) at(ins, "apt-get install without apt-get update in the same RUN");
        if (!/rm -rf \/var\/lib\/apt\/lists/.test(ins.args)) at(ins, "apt-get install without rm -rf /var/lib/apt/lists/* in the same RUN");
      }
      if (/pip3? install/.test(ins.args) && !/--no-cache-dir/.test(ins.args)) at(ins, "pip install without --no-cache-dir");
      for (const m of ins.args.matchAll(/(?:^|\s)((?:\.\/)?(?:docker|scripts)\/[\w.-]+)/g)) {
        const p = path.join(repo, m[1]);
        if (m[1].startsWith("docker/") && !fs.existsSync(p)) at(ins, `RUN ${m[1]}: not in the repository`);
      }
    }
  }
  const last = st[st.length - 1];
  if (last) {
    const users = last.body.filter((i) => i.kw === "USER");
    const user = users.length ? users[users.length - 1].args.split(":")[0] : "root";
    if (user === "root" || user === "0") errs.push(`${rel}: the final stage runs as root (add USER)`);
    if (!last.body.some((i) => i.kw === "HEALTHCHECK")) errs.push(`${rel}: the final stage has no HEALTHCHECK`);
  }
  const build = st.find((s) => s.name === "build");
  if (!build) errs.push(`${rel}: no stage named build`);
  else if (!build.body.some((i) => i.kw === "RUN" && /^\.\/scripts\/setup\.sh\b/.test(i.args))) {
    errs.push(`${rel}: the build stage must RUN ./scripts/setup.sh (the project's own build)`);
  }
  return { errs, build, last };
}

function lintRepo(repo) {
  const dir = path.join(repo, "docker");
  const files = fs.readdirSync(dir).filter((f) => f.endsWith(".Dockerfile")).sort();
  const results = Object.fromEntries(files.map((f) => [f, lint(path.join(dir, f), repo)]));
  const errs = files.flatMap((f) => results[f].errs);
  const agg = results["aggregator.Dockerfile"];
  if (!agg) errs.push("docker/aggregator.Dockerfile is missing");
  else {
    if (!agg.last.body.some((i) => i.kw === "HEALTHCHECK" && /\bCMD\b/.test(i.args))) errs.push("docker/aggregator.Dockerfile: the aggregator image needs a HEALTHCHECK CMD");
    if (!agg.last.body.some((i) => i.kw === "COPY" && i.args.includes("build/server/hsbn-aggregator"))) errs.push("docker/aggregator.Dockerfile: does not install build/server/hsbn-aggregator");
    // The steps up to and including setup.sh are the same in every image: one build, no drift.
    const prefix = (s) => { const i = s.body.findIndex((x) => /scripts\/setup\.sh/.test(x.args)); return JSON.stringify([s.image, s.body.slice(0, i + 1).map((x) => [x.kw, x.args])]); };
    for (const [f, r] of Object.entries(results)) {
      if (r.build && agg.build && prefix(r.build) !== prefix(agg.build)) errs.push(`docker/${f}: its build stage differs from aggregator.Dockerfile's up to scripts/setup.sh`);
    }
  }
  return { files, errs };
}

const MUTATIONS = [
  ["docker/aggregator.Dockerfile", "USER 10001:10001\n", "", "runs as root"],
  ["docker/aggregator.Dockerfile", "apt-get install -y --no-install-recommends", "apt-get install -y", "--no-install-recommends"],
  ["docker/aggregator.Dockerfile", "HEALTHCHECK --interval=10s", "HEALTHCHECK --intervall=10s", "dockerfile-utils"],
  ["docker/aggregator.Dockerfile", "ARG DEBIAN_SLIM_IMAGE=debian:12.8-slim", "ARG DEBIAN_SLIM_IMAGE=debian:latest", "uses :latest"],
  ["docker/aggregator.Dockerfile", "ENTRYPOINT [\"/usr/local/bin/hsbn-aggregator\"]", "ENTRYPOINT ['/usr/local/bin/hsbn-aggregator']", "dockerfile-utils"],
  ["docker/trainer.Dockerfile", "RUN ./scripts/setup.sh\n", "RUN cmake -S . -B build && cmake --build build\n", "scripts/setup.sh"],
  ["docker/trainer.Dockerfile", "COPY . .\nRUN ./scripts/setup.sh", "COPY . .\nRUN apt-get update\nRUN ./scripts/setup.sh", "differs from aggregator.Dockerfile"],
  ["docker/trainer.Dockerfile", "pip install --no-cache-dir --no-deps", "pip install --no-deps", "--no-cache-dir"],
  ["docker/trainer.Dockerfile", "COPY --from=build /src/build/dist/", "COPY --from=biuld /src/build/dist/", "no such stage"],
  ["docker/aggregator.Dockerfile", "COPY . .", "COPY . .\nCOPY hsbn-missing.conf /etc/", "not in the repository"],
];

function selfTest(repo) {
  const os = require("os");
  if (lintRepo(repo).errs.length) { console.log("FAIL: the unmodified Dockerfiles do not lint clean"); return 1; }
  let failed = 0;
  for (const [file, from, to, expect] of MUTATIONS) {
    const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "hsbn-docker-"));
    fs.cpSync(path.join(repo, "docker"), path.join(tmp, "docker"), { recursive: true });
    fs.mkdirSync(path.join(tmp, "client"));
    fs.symlinkSync(path.join(repo, "client", "python"), path.join(tmp, "client", "python"));
    const text = fs.readFileSync(path.join(tmp, file), "utf8");
    if (!text.includes(from)) { console.log(`FAIL: ${file} no longer contains ${JSON.stringify(from)}`); failed++; continue; }
    fs.writeFileSync(path.join(tmp, file), text.replace(from, to));
    const { errs } = lintRepo(tmp);
    fs.rmSync(tmp, { recursive: true, force: true });
    const hit = errs.find((e) => e.includes(expect));
    if (hit) console.log(`ok: ${file}: ${JSON.stringify(to.trim() || "(removed) " + from.trim())} caught: ${hit}`);
    else { console.log(`FAIL: ${file}: ${JSON.stringify(to)} not caught with "${expect}": ${JSON.stringify(errs)}`); failed++; }
  }
  console.log(`${MUTATIONS.length - failed} passed, ${failed} failed`);
  return failed ? 1 : 0;
}

const args = process.argv.slice(2);
if (args[0] === "--self-test") process.exit(selfTest(path.resolve(args[1])));
const { files, errs } = lintRepo(path.resolve(args[0]));
for (const e of errs) console.log(e);
console.log(`${errs.length ? "FAIL" : "ok"}: ${files.join(", ")}: ${errs.length} finding(s)`);
process.exit(errs.length ? 1 : 0);
