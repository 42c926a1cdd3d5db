// The source that builds ddp_test_pch's precompiled header (tests/CMakeLists.txt): the test
// executables' third-party and standard headers. It has nothing of its own.
