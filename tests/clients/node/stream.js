// Streams greedy sessions from a kvfleet scheduler with grpc-js (not Python's gRPC stack).
// usage: node stream.js HOST:PORT MAX_NEW_TOKENS PROMPT [PROMPT ...]   (PROMPT: ids joined by ",")
// Prints one JSON line per event: {"i": session index, "tokens": [...], "worker": ..., "finished": ...},
// and {"i": ..., "error": code, "details": ...} when a stream fails. Exit code 0 when all finish.
"use strict";
const path = require("path");
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");

const protos = path.resolve(__dirname, "../../../protos");
const def = loader.loadSync("kvfleet/v1/scheduler.proto", {
  includeDirs: [protos], keepCase: true, longs: Number, enums: String, defaults: true,
});
const kvfleet = grpc.loadPackageDefinition(def).kvfleet.v1;

const [address, maxNew, ...prompts] = process.argv.slice(2);
const client = new kvfleet.Scheduler(address, grpc.credentials.createInsecure());
let open = prompts.length;
let failed = false;

prompts.forEach((prompt, i) => {
  const ids = prompt.split(",").map(Number);
  const call = client.Generate({
    prompt_ids: { ids }, max_new_tokens: Number(maxNew), ignore_eos: true,
    sampling: { temperature: 0 },
  });
  call.on("data", (ev) => {
    console.log(JSON.stringify({ i, tokens: ev.token_ids, worker: ev.worker_id,
                                 finished: ev.finished, reason: ev.finish_reason }));
  });
  call.on("error", (err) => {
    console.log(JSON.stringify({ i, error: err.code, details: err.details }));
    failed = true;
  });
  // "status" comes once per call, after its last message or its error.
  call.on("status", () => { open -= 1; if (open === 0) process.exit(failed ? 2 : 0); });
});
