// SIGUSR1 dumps of the flight recorders (internal; see flight_recorder.h).
//
// Every enabled FlightRecorder registers itself here while it lives. The first registration in a
// process installs a SIGUSR1 handler, unless the program has its own handler or ignores the signal
// (then nothing is installed and a note is printed once), and starts a dump thread. The handler
// only writes a byte to a pipe (async-signal-safe); the thread reads it and dumps every
// registered recorder with reason "signal". After fork() the child starts its own thread and pipe
// at its first registration. The thread and the registry live until the process exits.
#pragma once

namespace ddp::comm {

class FlightRecorder;

void register_for_signal_dumps(FlightRecorder* recorder);
// Returns once no dump of `recorder` is running or can start.
void unregister_for_signal_dumps(FlightRecorder* recorder);

// Whether SIGUSR1 is ddp's (the program had no handler of its own when the first recorder came).
bool signal_dumps_installed();

// Dumps every registered recorder now (what SIGUSR1 does, from the dump thread); for tests.
void dump_all_flight_recorders();

}  // namespace ddp::comm
