# Job classes for a real Ruby Sidekiq 6.4.1 server, used by the interop tests.
#
# Run (from any directory; -r wants an absolute path or one starting with ./):
#
#   REDIS_URL=redis://127.0.0.1:PORT/0 \
#     ruby /usr/bin/sidekiq -r /abs/path/tests/interop/worker.rb -c 2 -t 5 -q default -q other
#
# Debian's ruby-sidekiq installs the `sidekiq` executable at /usr/bin/sidekiq
# (a RubyGems wrapper around the gem's bin/sidekiq; `Gem.bin_path("sidekiq",
# "sidekiq")` finds the real one). Sidekiq reads the Redis URL from REDIS_URL.
#
# Stopping it cleanly: SIGTERM (or SIGINT). Sidekiq stops fetching, waits up
# to -t seconds (default 25) for running jobs, pushes unfinished jobs back onto
# their queues, removes itself from the `processes` set and exits 0.
# SIGTSTP only quiets it (no new jobs) and it keeps running.
require "json"
require "sidekiq"

# The tests wait on Sidekiq's clocks, so run them faster than in production:
# poll `schedule` and `retry` about once a second with no 10 s head start
# (setting the average is what skips INITIAL_WAIT) and the first poll within a
# second of boot, not a random 0-5 s (initial_wait spreads the first polls of
# many processes; there is one here), and beat every second, not every 5 s, so
# that busy counts and remote signals are seen sooner. Nothing else in Sidekiq's
# behaviour changes.
Sidekiq.options[:poll_interval_average] = 1
if defined?(Sidekiq::Launcher)
  Sidekiq::Launcher.send(:remove_const, :BEAT_PAUSE)
  Sidekiq::Launcher.const_set(:BEAT_PAUSE, 1)
end
if defined?(Sidekiq::Scheduled::Poller)
  Sidekiq::Scheduled::Poller.prepend(Module.new do
    def initial_wait
      @sleeper.pop(rand)
    rescue Timeout::Error
    end
  end)
end

# Records each run: RPUSH interop:sidekiq_ran {"args": [...], "jid": "..."}
class InteropJob
  include Sidekiq::Worker

  def perform(*args)
    Sidekiq.redis do |conn|
      conn.rpush("interop:sidekiq_ran", JSON.generate({"args" => args, "jid" => jid}))
    end
  end
end

# Records the attempt on interop:sidekiq_failed, then raises.
class FailingJob
  include Sidekiq::Worker

  def perform(*args)
    Sidekiq.redis do |conn|
      conn.rpush("interop:sidekiq_failed", JSON.generate({"args" => args, "jid" => jid}))
    end
    raise ArgumentError, "FailingJob always fails (args: #{args.inspect})"
  end
end

# Sleeps ARGS[0] seconds: something for the inspection API to see running.
class SlowJob
  include Sidekiq::Worker

  def perform(seconds)
    sleep(seconds)
  end
end

# Always fails. Pushed with retry 0 (push.rb --retry 0), a failure goes straight to the
# dead set, written by Sidekiq itself: the payload's option counts, not the class's.
class DoomedJob
  include Sidekiq::Worker

  def perform(*args)
    raise RuntimeError, "DoomedJob gives up at once (args: #{args.inspect})"
  end
end
