// The native gRPC transport of `tensorkiln serve --grpc-transport native`: gRPC C++'s callback
// generic service carries the KServe v2 RPCs; the serving process (Python, through ctypes)
// receives each request message as bytes and answers it with tk_reply. HTTP/2, flow control
// and message framing run here, outside the interpreter; the protocol (parsing, checks, the
// engine) stays in Python, as with the grpcio transport.
//
// A call is one reactor. Unary RPCs: one request, one tk_reply (a message, or a status that ends
// the call). ModelStreamInfer: each request is handed over only after the previous one's answer
// was written, so answers keep the requests' order; the stream ends when the client half-closes.
// The embedding process must answer every handed-over request exactly once (it is how the call
// is finished and freed).
//
// C ABI only (no Python headers): one build serves every Python version.

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

extern "C" {
// (call, method, method length, request bytes, streaming): the request is read with
// tk_request_copy during this callback; the answer comes later through tk_reply.
typedef void (*tk_handler_fn)(void* call, const char* method, size_t method_len,
                              size_t request_len, int streaming);
}

namespace {

constexpr char kStream[] = "/inference.GRPCInferenceService/ModelStreamInfer";

class Call final : public grpc::ServerGenericBidiReactor {
 public:
  Call(grpc::GenericCallbackServerContext* ctx, tk_handler_fn handler)
      : handler_(handler), method_(ctx->method()), streaming_(method_ == kStream) {
    StartRead(&request_);
  }

  // (a unary call reads once; a stream reads again after each answer is written)
  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed (or the call ended) with no request outstanding
      Finish(streaming_ ? grpc::Status::OK
                        : grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request message"));
      return;
    }
    handler_(this, method_.data(), method_.size(), request_.Length(), streaming_ ? 1 : 0);
    // (the handler copied the request; a reply may already have been given)
  }

  // Copies the request being handed over into dst (request_len bytes); 0 on success.
  int CopyRequest(char* dst, size_t len) {
    if (len != request_.Length()) return 1;
    std::vector<grpc::Slice> slices;
    if (!request_.Dump(&slices).ok()) return 2;
    size_t at = 0;
    for (const auto& s : slices) {
      std::memcpy(dst + at, s.begin(), s.size());
      at += s.size();
    }
    return at == len ? 0 : 3;
  }

  void Reply(const char* data, size_t len, int code, const char* message) {
    if (code != 0) {
      Finish(grpc::Status(static_cast<grpc::StatusCode>(code), message ? message : ""));
      return;
    }
    grpc::Slice slice(data, len);  // (a copy: the caller's buffer may go right after)
    response_ = grpc::ByteBuffer(&slice, 1);
    request_.Clear();
    if (streaming_) {
      StartWrite(&response_);
    } else {
      StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
    }
  }

  void OnWriteDone(bool ok) override {  // (streams only: a unary write finishes the call)
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the stream was closed"));
      return;
    }
    StartRead(&request_);  // the stream's next request
  }

  void OnDone() override { delete this; }

 private:
  tk_handler_fn handler_;
  std::string method_;
  bool streaming_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
};

class Service final : public grpc::CallbackGenericService {
 public:
  explicit Service(tk_handler_fn handler) : handler_(handler) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    return new Call(ctx, handler_);
  }

 private:
  tk_handler_fn handler_;
};

struct Server {
  explicit Server(tk_handler_fn handler) : service(handler) {}
  Service service;
  std::unique_ptr<grpc::Server> server;
};

}  // namespace

extern "C" {

int tk_abi_version() { return 1; }

// Starts a server on `address` ("host:port"; port 0: any free one, written to *port). Returns
// the server, or null with a reason in err.
void* tk_start(const char* address, long long max_message, int reuse_port, tk_handler_fn handler,
               int* port, char* err, size_t err_len) {
  auto* s = new Server(handler);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), port);
  builder.RegisterCallbackGenericService(&s->service);
  const int limit = max_message > 0x7fffffff ? 0x7fffffff : static_cast<int>(max_message);
  builder.SetMaxReceiveMessageSize(limit);
  builder.SetMaxSendMessageSize(limit);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, reuse_port ? 1 : 0);
  builder.AddChannelArgument("grpc.http2.lookahead_bytes", 16 << 20);
  s->server = builder.BuildAndStart();
  if (!s->server || *port == 0) {
    std::snprintf(err, err_len, "cannot listen for gRPC on %s", address);
    delete s;
    return nullptr;
  }
  return s;
}

int tk_request_copy(void* call, char* dst, size_t len) {
  return static_cast<Call*>(call)->CopyRequest(dst, len);
}

void tk_reply(void* call, const char* data, size_t len, int code, const char* message) {
  static_cast<Call*>(call)->Reply(data, len, code, message);
}

// Stops taking calls, cancels those still open after `grace` seconds and frees the server. It
// waits for every handed-over request to be answered: answer them all (from another thread).
void tk_stop(void* server, double grace) {
  auto* s = static_cast<Server*>(server);
  auto deadline = std::chrono::system_clock::now() +
                  std::chrono::microseconds(static_cast<long long>(grace * 1e6));
  s->server->Shutdown(deadline);
  s->server->Wait();
  delete s;
}

}  // extern "C"
