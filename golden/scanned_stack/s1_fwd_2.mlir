module @jit_s1_fwd_2 attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg1: tensor<2x16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}, %arg2: tensor<2x8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}, %arg3: tensor<2x8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}, %arg4: tensor<2x8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}) -> (tensor<8x16xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<2x16x16xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}) {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<2x16x16xf32>
    %c = stablehlo.constant dense<0> : tensor<i32>
    %1:7 = stablehlo.while(%iterArg = %arg1, %iterArg_0 = %arg2, %iterArg_1 = %arg3, %iterArg_2 = %arg4, %iterArg_3 = %c, %iterArg_4 = %arg0, %iterArg_5 = %0) : tensor<2x16x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<i32>, tensor<8x16xf32>, tensor<2x16x16xf32>
    cond {
      %c_6 = stablehlo.constant dense<2> : tensor<i32>
      %2 = stablehlo.compare LT, %iterArg_3, %c_6, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %2 : tensor<i1>
    } do {
      %c_6 = stablehlo.constant dense<2> : tensor<i32>
      %2 = stablehlo.subtract %c_6, %iterArg_3 : tensor<i32>
      %c_7 = stablehlo.constant dense<1> : tensor<i32>
      %3 = stablehlo.subtract %2, %c_7 : tensor<i32>
      %4 = func.call @dynamic_index_in_dim(%iterArg, %3) : (tensor<2x16x16xf32>, tensor<i32>) -> tensor<16x16xf32>
      %5 = func.call @dynamic_index_in_dim_0(%iterArg_0, %3) : (tensor<2x8x16xf32>, tensor<i32>) -> tensor<8x16xf32>
      %6 = func.call @dynamic_index_in_dim_0(%iterArg_1, %3) : (tensor<2x8x16xf32>, tensor<i32>) -> tensor<8x16xf32>
      %7 = func.call @dynamic_index_in_dim_0(%iterArg_2, %3) : (tensor<2x8x16xf32>, tensor<i32>) -> tensor<8x16xf32>
      %8:2 = func.call @closed_call(%iterArg_4, %4, %5, %6, %7) : (tensor<8x16xf32>, tensor<16x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>) -> (tensor<8x16xf32>, tensor<16x16xf32>)
      %9 = func.call @dynamic_update_index_in_dim(%iterArg_5, %8#1, %3) : (tensor<2x16x16xf32>, tensor<16x16xf32>, tensor<i32>) -> tensor<2x16x16xf32>
      %c_8 = stablehlo.constant dense<1> : tensor<i32>
      %10 = stablehlo.add %iterArg_3, %c_8 : tensor<i32>
      stablehlo.return %iterArg, %iterArg_0, %iterArg_1, %iterArg_2, %10, %8#0, %9 : tensor<2x16x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<i32>, tensor<8x16xf32>, tensor<2x16x16xf32>
    }
    return %1#5, %1#6 : tensor<8x16xf32>, tensor<2x16x16xf32>
  }
  func.func private @dynamic_index_in_dim(%arg0: tensor<2x16x16xf32>, %arg1: tensor<i32>) -> tensor<16x16xf32> {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %c_0 = stablehlo.constant dense<0> : tensor<i32>
    %0 = stablehlo.dynamic_slice %arg0, %arg1, %c, %c_0, sizes = [1, 16, 16] : (tensor<2x16x16xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x16x16xf32>
    %1 = stablehlo.reshape %0 : (tensor<1x16x16xf32>) -> tensor<16x16xf32>
    return %1 : tensor<16x16xf32>
  }
  func.func private @dynamic_index_in_dim_0(%arg0: tensor<2x8x16xf32>, %arg1: tensor<i32>) -> tensor<8x16xf32> {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %c_0 = stablehlo.constant dense<0> : tensor<i32>
    %0 = stablehlo.dynamic_slice %arg0, %arg1, %c, %c_0, sizes = [1, 8, 16] : (tensor<2x8x16xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x8x16xf32>
    %1 = stablehlo.reshape %0 : (tensor<1x8x16xf32>) -> tensor<8x16xf32>
    return %1 : tensor<8x16xf32>
  }
  func.func private @closed_call(%arg0: tensor<8x16xf32>, %arg1: tensor<16x16xf32>, %arg2: tensor<8x16xf32>, %arg3: tensor<8x16xf32>, %arg4: tensor<8x16xf32>) -> (tensor<8x16xf32>, tensor<16x16xf32>) {
    %0 = stablehlo.multiply %arg0, %arg4 : tensor<8x16xf32>
    %1 = stablehlo.multiply %0, %arg3 : tensor<8x16xf32>
    %2 = stablehlo.add %0, %1 : tensor<8x16xf32>
    %3 = stablehlo.dot_general %2, %arg2, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<16x16xf32>
    %4 = stablehlo.transpose %3, dims = [1, 0] : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %5 = stablehlo.dot_general %2, %arg1, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
    return %5, %4 : tensor<8x16xf32>, tensor<16x16xf32>
  }
  func.func private @dynamic_update_index_in_dim(%arg0: tensor<2x16x16xf32>, %arg1: tensor<16x16xf32>, %arg2: tensor<i32>) -> tensor<2x16x16xf32> {
    %0 = stablehlo.broadcast_in_dim %arg1, dims = [1, 2] : (tensor<16x16xf32>) -> tensor<1x16x16xf32>
    %c = stablehlo.constant dense<0> : tensor<i32>
    %c_0 = stablehlo.constant dense<0> : tensor<i32>
    %1 = stablehlo.dynamic_update_slice %arg0, %0, %arg2, %c, %c_0 : (tensor<2x16x16xf32>, tensor<1x16x16xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<2x16x16xf32>
    return %1 : tensor<2x16x16xf32>
  }
}
