// The native gRPC transport of `tensorkiln serve --grpc-transport native`: gRPC C++'s callback
// generic service carries the KServe v2 RPCs; the serving process (Python, through ctypes)
// takes each request message as bytes and answers it with tk_reply. HTTP/2, flow control and
// message framing run here, outside the interpreter; the protocol (parsing, checks, the engine)
// stays in Python, as with the grpcio transport.
//
// A call is one reactor. Unary RPCs: one request, one tk_reply (a message, or a status that ends
// the call). ModelStreamInfer: each request is handed over only after the previous one's answer
// was written, so answers keep the requests' order; the stream ends when the client half-closes.
// A received request waits in the server's queue, and the eventfd given to tk_start is signalled;
// the embedding process takes the waiting requests with tk_next (on its own thread, when the
// eventfd is readable: no gRPC thread ever calls into it). It must answer every request it
// takes exactly once, and keep taking them until tk_stop returns (that is how calls are finished
// and freed).
//
// C ABI only (no Python headers): one build serves every Python version.

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr char kStream[] = "/inference.GRPCInferenceService/ModelStreamInfer";

class Call;

// The received requests waiting to be taken, and the eventfd that says there are some.
class Inbox {
 public:
  explicit Inbox(int efd) : efd_(efd) {}

  void Push(Call* call) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready_.push_back(call);
    }
    const uint64_t one = 1;
    // (the counter cannot overflow here; a failed write would only delay the wake-up)
    [[maybe_unused]] ssize_t n = write(efd_, &one, sizeof(one));
  }

  Call* Pop() {
    std::lock_guard<std::mutex> lock(mu_);
    if (ready_.empty()) return nullptr;
    Call* call = ready_.front();
    ready_.pop_front();
    return call;
  }

 private:
  int efd_;
  std::mutex mu_;
  std::deque<Call*> ready_;
};

class Call final : public grpc::ServerGenericBidiReactor {
 public:
  Call(grpc::GenericCallbackServerContext* ctx, Inbox* inbox)
      : inbox_(inbox), method_(ctx->method()), streaming_(method_ == kStream) {
    StartRead(&request_);
  }

  const std::string& method() const { return method_; }
  bool streaming() const { return streaming_; }
  size_t request_length() { return request_.Length(); }

  // (a unary call reads once; a stream reads again after each answer is written)
  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed (or the call ended) with no request outstanding
      Finish(streaming_ ? grpc::Status::OK
                        : grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request message"));
      return;
    }
    inbox_->Push(this);  // (taken with tk_next, answered with tk_reply)
  }

  // Copies the request taken with tk_next into dst (request_len bytes); 0 on success.
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
  Inbox* inbox_;
  std::string method_;
  bool streaming_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
};

class Service final : public grpc::CallbackGenericService {
 public:
  explicit Service(Inbox* inbox) : inbox_(inbox) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    return new Call(ctx, inbox_);
  }

 private:
  Inbox* inbox_;
};

struct Server {
  explicit Server(int efd) : inbox(efd), service(&inbox) {}
  Inbox inbox;
  Service service;
  std::unique_ptr<grpc::Server> server;
};

}  // namespace

extern "C" {

int tk_abi_version() { return 2; }

// Starts a server on `address` ("host:port"; port 0: any free one, written to *port) that
// signals the eventfd `efd` (the caller's; it outlives the server) when requests are waiting.
// Returns the server, or null with a reason in err.
void* tk_start(const char* address, long long max_message, int reuse_port, int efd, int* port,
               char* err, size_t err_len) {
  auto* s = new Server(efd);
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

// The next waiting request (null: none): its call, method and length, read with
// tk_request_copy and answered with tk_reply.
void* tk_next(void* server, const char** method, size_t* method_len, size_t* request_len,
              int* streaming) {
  Call* call = static_cast<Server*>(server)->inbox.Pop();
  if (call != nullptr) {
    *method = call->method().data();
    *method_len = call->method().size();
    *request_len = call->request_length();
    *streaming = call->streaming() ? 1 : 0;
  }
  return call;
}

int tk_request_copy(void* call, char* dst, size_t len) {
  return static_cast<Call*>(call)->CopyRequest(dst, len);
}

void tk_reply(void* call, const char* data, size_t len, int code, const char* message) {
  static_cast<Call*>(call)->Reply(data, len, code, message);
}

// Stops taking calls, cancels those still open after `grace` seconds and frees the server. It
// waits for every received request to be answered: keep taking and answering them (from
// another thread) until it returns.
void tk_stop(void* server, double grace) {
  auto* s = static_cast<Server*>(server);
  auto deadline = std::chrono::system_clock::now() +
                  std::chrono::microseconds(static_cast<long long>(grace * 1e6));
  s->server->Shutdown(deadline);
  s->server->Wait();
  delete s;
}

}  // extern "C"
