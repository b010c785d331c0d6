// grpc_floor.py's C++ stand-in: a bare KServe v2 gRPC service (gRPC C++'s synchronous server)
// that answers ModelInfer with a response recorded from the real server (the request's raw
// contents are walked, as a server reads them; no model, no checks), the metadata and config
// with the real server's, and statistics that count its requests, as the Python stand-ins do;
// shared-memory registrations are accepted (a client with its tensors there sends small
// requests). What a gRPC server costs when its protocol work is not in Python.
//   grpc_floor_stand_in RECORDED PORT     (build: benchmarks/grpc_floor_cpp/build.sh)
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "grpc_service.grpc.pb.h"

namespace inf = inference;
using grpc::ServerContext;
using grpc::Status;

namespace {

std::vector<std::string> Split(const std::string& text, const std::string& sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t at; (at = text.find(sep, start)) != std::string::npos; start = at + sep.size()) {
    out.push_back(text.substr(start, at - start));
  }
  out.push_back(text.substr(start));
  return out;
}

class StandIn final : public inf::GRPCInferenceService::Service {
 public:
  explicit StandIn(const std::vector<std::string>& blobs) {
    meta_.ParseFromString(blobs[0]);
    config_.ParseFromString(blobs[1]);
    server_meta_.ParseFromString(blobs[2]);
    answer_.ParseFromString(blobs[3]);
  }

  Status ServerLive(ServerContext*, const inf::ServerLiveRequest*,
                    inf::ServerLiveResponse* reply) override {
    reply->set_live(true);
    return Status::OK;
  }
  Status ServerReady(ServerContext*, const inf::ServerReadyRequest*,
                     inf::ServerReadyResponse* reply) override {
    reply->set_ready(true);
    return Status::OK;
  }
  Status ModelReady(ServerContext*, const inf::ModelReadyRequest*,
                    inf::ModelReadyResponse* reply) override {
    reply->set_ready(true);
    return Status::OK;
  }
  Status ServerMetadata(ServerContext*, const inf::ServerMetadataRequest*,
                        inf::ServerMetadataResponse* reply) override {
    *reply = server_meta_;
    return Status::OK;
  }
  Status ModelMetadata(ServerContext*, const inf::ModelMetadataRequest*,
                       inf::ModelMetadataResponse* reply) override {
    *reply = meta_;
    return Status::OK;
  }
  Status ModelConfig(ServerContext*, const inf::ModelConfigRequest*,
                     inf::ModelConfigResponse* reply) override {
    *reply = config_;
    return Status::OK;
  }
  Status ModelInfer(ServerContext*, const inf::ModelInferRequest* request,
                    inf::ModelInferResponse* reply) override {
    size_t bytes = 0;
    for (const auto& raw : request->raw_input_contents()) bytes += raw.size();  // (viewed)
    (void)bytes;
    *reply = answer_;
    reply->set_id(request->id());
    served_++;
    return Status::OK;
  }
  // Shared-memory registrations are accepted and forgotten: a client whose tensors are in
  // shared memory sends requests without them, and the recorded answer goes back as it is.
#define TK_ACCEPT(rpc)                                                          \
  Status rpc(ServerContext*, const inf::rpc##Request*, inf::rpc##Response*) override { \
    return Status::OK;                                                          \
  }
  TK_ACCEPT(SystemSharedMemoryRegister)
  TK_ACCEPT(SystemSharedMemoryUnregister)
  TK_ACCEPT(SystemSharedMemoryStatus)
  TK_ACCEPT(CudaSharedMemoryRegister)
  TK_ACCEPT(CudaSharedMemoryUnregister)
  TK_ACCEPT(CudaSharedMemoryStatus)
#undef TK_ACCEPT

  Status ModelStatistics(ServerContext*, const inf::ModelStatisticsRequest* request,
                         inf::ModelStatisticsResponse* reply) override {
    const long n = served_.load();
    auto* model = reply->add_model_stats();
    model->set_name(request->name());
    model->set_version("1");
    model->set_last_inference(1);
    model->set_inference_count(n);
    model->set_execution_count(n);
    auto* stats = model->mutable_inference_stats();
    for (auto* d : {stats->mutable_success(), stats->mutable_queue(),
                    stats->mutable_compute_input(), stats->mutable_compute_infer(),
                    stats->mutable_compute_output()}) {
      d->set_count(n);
      d->set_ns(n * 1000);
    }
    return Status::OK;
  }

 private:
  inf::ModelMetadataResponse meta_;
  inf::ModelConfigResponse config_;
  inf::ServerMetadataResponse server_meta_;
  inf::ModelInferResponse answer_;
  std::atomic<long> served_{0};
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: grpc_floor_stand_in RECORDED PORT\n";
    return 2;
  }
  std::ifstream file(argv[1], std::ios::binary);
  std::stringstream text;
  text << file.rdbuf();
  const auto blobs = Split(text.str(), std::string("\0SPLIT\0", 7));
  if (!file || blobs.size() != 4) {
    std::cerr << "grpc_floor_stand_in: " << argv[1] << " is not a recording of grpc_floor.py\n";
    return 2;
  }
  StandIn service(blobs);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(std::string("127.0.0.1:") + argv[2],
                           grpc::InsecureServerCredentials());
  builder.SetMaxReceiveMessageSize(64 << 20);  // (the real server's limits)
  builder.SetMaxSendMessageSize(64 << 20);
  builder.AddChannelArgument("grpc.http2.lookahead_bytes", 16 << 20);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  if (!server) {
    std::cerr << "grpc_floor_stand_in: cannot listen on port " << argv[2] << "\n";
    return 1;
  }
  std::cout << "ready" << std::endl;
  server->Wait();
}
