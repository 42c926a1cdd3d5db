// Which sanitizer this test is built under, for tests that cannot run under one: GCC defines
// __SANITIZE_ADDRESS__ and __SANITIZE_THREAD__, clang 14 (the asan and fuzz stages) only answers
// __has_feature.
//
//   #if DDP_TEST_UNDER_ASAN || DDP_TEST_UNDER_TSAN
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define DDP_TEST_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DDP_TEST_UNDER_ASAN 1
#endif
#endif
#ifndef DDP_TEST_UNDER_ASAN
#define DDP_TEST_UNDER_ASAN 0
#endif

#if defined(__SANITIZE_THREAD__)
#define DDP_TEST_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DDP_TEST_UNDER_TSAN 1
#endif
#endif
#ifndef DDP_TEST_UNDER_TSAN
#define DDP_TEST_UNDER_TSAN 0
#endif
