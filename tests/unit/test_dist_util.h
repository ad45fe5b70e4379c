// Helpers for the src/comm tests: ranks as threads of this process, each with its own Comm on one
// shared c10d::HashStore (Gloo over loopback, no rendezvous port), and a free TCP port for the tests
// that use real TCP stores.
#pragma once
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/comm.h"

namespace ddm::test {

// As the ddm binary does (apps/ddm.cpp): a write to the socket of a rank that has gone must fail as an
// error the collective reports, not kill the whole test process (every rank is a thread of it) with
// SIGPIPE. Set once, before any test runs, by every test file that includes this header.
static const bool kSigpipeIgnored = [] {
  std::signal(SIGPIPE, SIG_IGN);
  return true;
}();

// Runs fn(comm) for ranks 0..world-1 on as many threads; returns each rank's exception message ("" when
// it returned normally). The Comms are destroyed on their threads after fn returns.
inline std::vector<std::string> run_ranks(int world, const CommOptions& options,
                                          const std::function<void(Comm&)>& fn) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        auto comm = Comm::create_for_test(store, r, world, options);
        fn(*comm);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

// Options with short timeouts, so a failing test ends within seconds.
inline CommOptions short_timeouts(int timeout_ms = 20000) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  o.connect_timeout = std::chrono::milliseconds(20000);
  return o;
}

// A TCP port on 127.0.0.1 that was free a moment ago (the kernel's choice for port 0).
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    throw std::runtime_error("free_port: no socket");
  ::close(fd);
  return ntohs(a.sin_port);
}

inline bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Prints an error message a test provoked when DDM_TEST_SHOW_MESSAGES is set (to read them all).
inline const std::string& shown(const std::string& msg) {
  if (std::getenv("DDM_TEST_SHOW_MESSAGES")) std::fprintf(stderr, "message: %s\n", msg.c_str());
  return msg;
}

}  // namespace ddm::test
