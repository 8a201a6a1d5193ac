// The OpenAI-compatible HTTP API over an EngineLoop (HTTP/1.1 through cpp-httplib, which Debian
// packages and which gives a thread per connection, chunked responses for server-sent events and a
// body-size limit; the API is JSON in and out, so its cost is parsing, not the server).
//
// Routes:
//   POST /v1/completions   prompt as text, a list of texts, token ids or a list of id lists (text
//                          needs the model's tokenizer). Fields: model, max_tokens (16), temperature
//                          (1), top_p, top_k, seed, n (choice i samples with seed + i), stream,
//                          stream_options.include_usage, ignore_eos, stop (up to 4 strings: the
//                          request is cancelled when its text reaches one, and the text ends before
//                          it), logprobs (k in [0, 20]: each token's log-probability and its k most
//                          probable alternatives; not with echo, since prompt tokens have none).
//                          Each choice carries `token_ids` (an extension) beside its text.
//   POST /v1/chat/completions   messages (text content) through the model's chat template; the same
//                          fields (logprobs true/false, top_logprobs k in [0, 20] with logprobs,
//                          max_completion_tokens); streamed as deltas.
// Log-probabilities are natural logs of the model's distribution (log-softmax of the raw logits,
// before temperature, top-k and top-p; common/top_logprobs.h); alternatives come most probable
// first, exactly k of them (the chosen token is among them only if it is one of the k most
// probable: always entry 0 under greedy sampling). Tokens appear as their text through the
// model's tokenizer (chat adds their UTF-8 `bytes`), or as decimal ids for a model without one.
//   GET  /v1/models, /health (503 until ready and while shutting down), /version, /metrics.
// Errors are OpenAI error objects ({"error": {"message", "type", "param", "code"}}): 400 bad JSON
// or field (the field named in `param`), 401 bad or missing key, 404 unknown model or route, 413
// body too large, 429 with Retry-After when api.max_waiting requests already wait, 503 not ready or
// shutting down. With api.key set, /v1/* and /metrics need "Authorization: Bearer <key>"
// (compared in constant time). A streaming client that disconnects cancels its requests.
//
// Thread safety: Start/Stop from one thread; handlers run on the server's connection threads.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/config.h"
#include "server/engine_loop.h"
#include "server/metrics.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace tandem::text {
class TextModel;
}

namespace tandem::server {

struct ApiOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (see ApiServer::port)
  std::string key;  // empty: no authentication
  int64_t max_body_bytes = 1 << 20;
  int max_connections = 512;  // connection threads
  std::string served_model_name = "tandem";
  int64_t max_n = 16;            // choices per request
  double shutdown_grace_s = 30;  // SIGTERM: requests in flight may finish for this long
};

// The "api.*" settings (host, port, key, max_waiting, max_body_bytes, max_connections,
// served_model_name, shutdown_grace_s) and their conversion.
void AddApiKnobs(ConfigSchema* schema);
ApiOptions ApiOptionsFromConfig(const Config& config);
LoopOptions LoopOptionsFromConfig(const Config& config);

class ApiServer {
 public:
  // Binds the socket and starts serving on a thread of its own; /health answers 503 until
  // SetLoop(). Unavailable naming host:port when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<ApiServer>> Start(const ApiOptions& options);
  ~ApiServer();
  ApiServer(const ApiServer&) = delete;
  ApiServer& operator=(const ApiServer&) = delete;

  int port() const { return port_; }
  // Ready: requests go to `loop` (which must outlive the server or be detached by Draining()).
  // With `text` (may be null: token ids only), prompts may be text, chats go through its template,
  // stop strings work and choices carry text. Call before SetLoop.
  void SetText(const text::TextModel* text) { text_ = text; }
  void SetLoop(EngineLoop* loop, ServerMetrics* metrics);
  // Shutting down: /health answers 503 and new requests 503; streams in flight go on.
  void Draining();
  // Stops listening and joins the server thread.
  void Stop();

 private:
  ApiServer() = default;
  void Routes();
  void Complete(const httplib::Request& req, httplib::Response& res, bool chat);
  const text::TextModel* text_ = nullptr;
  ApiOptions options_;
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  int port_ = 0;
  std::atomic<EngineLoop*> loop_{nullptr};
  std::atomic<ServerMetrics*> metrics_{nullptr};
  std::atomic<bool> draining_{false};
};

}  // namespace tandem::server
