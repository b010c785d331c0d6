// The native gRPC transport of `tensorkiln serve --grpc-transport native`: gRPC C++'s async
// generic service carries the KServe v2 RPCs; the serving process (Python, through ctypes)
// takes each request message as bytes and answers it with tk_reply. HTTP/2, flow control and
// message framing run here, outside the interpreter; the protocol (parsing, checks, the engine)
// stays in Python, as with the grpcio transport.
//
// One completion queue, polled by the transport's own threads ("pumps", one by default): a
// pump does the socket work itself and hands a received request straight to the server's
// queue, with no further thread in between (gRPC's callback API runs each callback on an
// executor thread of its own, one more wake-up on every request's path). With busy polling
// (tk_busy_poll) the first pump keeps polling the sockets for a while after each answer
// instead of sleeping in epoll, so the next request of a client is read as soon as it lands.
// An answer is sent from the thread that gives it when no other request waits for its own
// (one client at a time: no hand-over), else by a pump (under load, sending is taken off the
// thread that runs the requests).
//
// A call: one request, one tk_reply (a message, or a status that ends the call).
// ModelStreamInfer: each request is handed over only after the previous one's answer was
// written, so answers keep the requests' order; the stream ends when the client half-closes.
// A received request waits in the server's queue, and the eventfd given to tk_start is
// signalled; the embedding process takes the waiting requests with tk_next (on its own thread,
// when the eventfd is readable: no gRPC thread ever calls into it). It must answer every request
// it takes exactly once, and keep taking them until tk_stop returns (that is how calls are
// finished and freed).
//
// C ABI only (no Python headers): one build serves every Python version.

#include <grpc/support/time.h>
#include <grpcpp/alarm.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr char kStream[] = "/inference.GRPCInferenceService/ModelStreamInfer";

// What a completion-queue tag says was done, in the low bits of the call's address (a Call
// holds pointers: aligned to 8 at least).
enum Op : uintptr_t { kNew = 0, kRead = 1, kWrite = 2, kFinish = 3, kSend = 4 };
constexpr uintptr_t kOpBits = 7;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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

struct Server;

class Call {
 public:
  explicit Call(Server* server) : server_(server), stream_(&ctx_) {}

  void* Tag(Op op) { return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(this) | op); }

  const std::string& method() const { return method_; }
  bool streaming() const { return streaming_; }
  size_t request_length() { return request_.Length(); }

  void Accept(grpc::AsyncGenericService* service, grpc::ServerCompletionQueue* cq) {
    service->RequestCall(&ctx_, &stream_, cq, cq, Tag(kNew));
  }

  void Started() {  // (a pump: the call arrived) read its (first) request
    method_ = ctx_.method();
    streaming_ = method_ == kStream;
    stream_.Read(&request_, Tag(kRead));
  }

  // (a pump) a stream's answer was written: read its next request, or end a broken stream
  void Written(bool ok) {
    if (!ok) {
      stream_.Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the stream was closed"),
                     Tag(kFinish));
      return;
    }
    stream_.Read(&request_, Tag(kRead));
  }

  // (a pump) no request came: the client half-closed (or the call ended)
  void NoRequest() {
    stream_.Finish(streaming_ ? grpc::Status::OK
                              : grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                             "no request message"),
                   Tag(kFinish));
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

  // (the embedding process's thread) the answer to the request taken: sent from this thread
  // when no other request is waiting for its answer (a client at a time: the answer goes at
  // once), else handed to a pump (under load, the sending, tens of microseconds a call, is
  // taken off the thread that runs the requests)
  void Reply(const char* data, size_t len, int code, const char* message);

  // (this thread or a pump) the answer kept by Reply, sent
  void Send() {
    if (!status_.ok()) {
      stream_.Finish(status_, Tag(kFinish));
    } else if (streaming_) {
      stream_.Write(response_, Tag(kWrite));
    } else {
      stream_.WriteAndFinish(response_, grpc::WriteOptions(), grpc::Status::OK, Tag(kFinish));
    }
  }

 private:
  Server* server_;
  grpc::GenericServerContext ctx_;
  grpc::GenericServerAsyncReaderWriter stream_;
  std::string method_;
  bool streaming_ = false;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
  grpc::Status status_;
  // (fires at once on the completion queue: a pump sends the answer; a new one each time, as
  // a stream hands over an answer only after the previous one was written)
  std::unique_ptr<grpc::Alarm> handover_;
};

struct Server {
  explicit Server(int efd) : inbox(efd) {}

  // A call object waiting for the next call to arrive (one always is, until shutdown).
  void Accept() {
    auto* call = new Call(this);
    live.fetch_add(1);
    call->Accept(&service, cq.get());
  }

  void Done(Call* call) {
    delete call;
    if (live.fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> lock(mu);
      idle.notify_all();
    }
  }

  void Handle(void* tag, bool ok) {
    auto* call = reinterpret_cast<Call*>(reinterpret_cast<uintptr_t>(tag) & ~kOpBits);
    switch (static_cast<Op>(reinterpret_cast<uintptr_t>(tag) & kOpBits)) {
      case kNew:
        if (!ok) {  // (the server is shutting down: no call came)
          Done(call);
          return;
        }
        if (!stopping.load()) Accept();
        call->Started();
        return;
      case kRead:
        if (ok) {
          waiting.fetch_add(1);
          inbox.Push(call);  // (taken with tk_next, answered with tk_reply)
        } else {
          call->NoRequest();
        }
        return;
      case kWrite:  // (streams only: a unary write finishes the call)
        call->Written(ok);
        return;
      case kFinish:
        Done(call);
        return;
      case kSend:  // (sent whatever ok says: only sending ends the call)
        call->Send();
        return;
    }
  }

  // Busy polling: the last answer went less than spin_ns ago. (Also while requests are being
  // answered: a pump that sleeps then must be woken to finish the answer, and is asleep when
  // the client's next request comes; under load it finds work on every look anyway.)
  bool Spinning() {
    return spin_ns.load(std::memory_order_relaxed) > 0 &&
           NowNs() < spin_until.load(std::memory_order_relaxed);
  }

  // A pump: takes what the completion queue says until it shuts down. The first one polls
  // without sleeping while busy polling says so.
  void Pump(bool first) {
    void* tag = nullptr;
    bool ok = false;
    const gpr_timespec now = gpr_inf_past(GPR_CLOCK_MONOTONIC);
    for (;;) {
      if (first && Spinning()) {
        const auto got = cq->AsyncNext(&tag, &ok, now);  // (one look at the sockets)
        if (got == grpc::CompletionQueue::TIMEOUT) continue;
        if (got == grpc::CompletionQueue::SHUTDOWN) return;
      } else if (!cq->Next(&tag, &ok)) {
        return;
      }
      Handle(tag, ok);
    }
  }

  Inbox inbox;
  grpc::AsyncGenericService service;
  std::unique_ptr<grpc::ServerCompletionQueue> cq;
  std::unique_ptr<grpc::Server> server;
  std::vector<std::thread> pumps;
  std::atomic<long long> live{0};  // call objects not yet freed
  std::atomic<bool> stopping{false};
  std::atomic<long long> waiting{0};  // requests handed over and not yet answered
  std::atomic<int64_t> spin_ns{0};
  std::atomic<int64_t> spin_until{0};
  std::mutex mu;
  std::condition_variable idle;
};

// (after Server: busy polling starts from each answer)
void Call::Reply(const char* data, size_t len, int code, const char* message) {
  const int64_t spin = server_->spin_ns.load(std::memory_order_relaxed);
  if (spin > 0) server_->spin_until.store(NowNs() + spin, std::memory_order_relaxed);
  const bool alone = server_->waiting.fetch_sub(1) == 1;
  if (code != 0) {
    status_ = grpc::Status(static_cast<grpc::StatusCode>(code), message ? message : "");
  } else {
    status_ = grpc::Status::OK;
    grpc::Slice slice(data, len);  // (a copy: the caller's buffer may go right after)
    response_ = grpc::ByteBuffer(&slice, 1);
    request_.Clear();
  }
  if (alone) {
    Send();
  } else {
    handover_ = std::make_unique<grpc::Alarm>();
    handover_->Set(server_->cq.get(), gpr_time_0(GPR_CLOCK_MONOTONIC), Tag(kSend));
  }
}

}  // namespace

extern "C" {

int tk_abi_version() { return 3; }

// Starts a server on `address` ("host:port"; port 0: any free one, written to *port) with
// `pumps` threads (1 to 64) polling its completion queue, that signals the eventfd `efd` (the
// caller's; it outlives the server) when requests are waiting. Returns the server, or null with
// a reason in err.
void* tk_start(const char* address, long long max_message, int reuse_port, int efd, int pumps,
               int* port, char* err, size_t err_len) {
  if (pumps < 1 || pumps > 64) {
    std::snprintf(err, err_len, "the gRPC transport takes 1 to 64 threads, not %d", pumps);
    return nullptr;
  }
  auto* s = new Server(efd);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), port);
  builder.RegisterAsyncGenericService(&s->service);
  const int limit = max_message > 0x7fffffff ? 0x7fffffff : static_cast<int>(max_message);
  builder.SetMaxReceiveMessageSize(limit);
  builder.SetMaxSendMessageSize(limit);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, reuse_port ? 1 : 0);
  builder.AddChannelArgument("grpc.http2.lookahead_bytes", 16 << 20);
  s->cq = builder.AddCompletionQueue();
  s->server = builder.BuildAndStart();
  if (!s->server || *port == 0) {
    std::snprintf(err, err_len, "cannot listen for gRPC on %s", address);
    if (s->server) s->server->Shutdown();
    s->cq->Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (s->cq->Next(&tag, &ok)) {
    }
    s->server.reset();
    delete s;
    return nullptr;
  }
  s->Accept();
  for (int i = 0; i < pumps; ++i) s->pumps.emplace_back(&Server::Pump, s, i == 0);
  return s;
}

// Busy polling: after each answer, the first pump polls the sockets for `us` microseconds
// (0: never) before it sleeps again.
void tk_busy_poll(void* server, long long us) {
  static_cast<Server*>(server)->spin_ns.store(us > 0 ? us * 1000 : 0);
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
  s->stopping.store(true);
  auto deadline = std::chrono::system_clock::now() +
                  std::chrono::microseconds(static_cast<long long>(grace * 1e6));
  s->server->Shutdown(deadline);
  {  // (the pumps finish the calls: each is answered, cancelled, or never came)
    std::unique_lock<std::mutex> lock(s->mu);
    s->idle.wait(lock, [s] { return s->live.load() == 0; });
  }
  s->cq->Shutdown();
  for (auto& t : s->pumps) t.join();
  s->server.reset();
  delete s;
}

}  // extern "C"
